/*
 * config.h - fsdp-train's run configuration (config.c): --config FILE, the
 * resolved configuration as JSON (printed at the start, the first line of
 * --log, meta.json's "train_config" in every checkpoint) and what --resume
 * restores from it. One table in config.c names every flag that takes part,
 * its type and whether --resume restores it.
 */
#ifndef FSDP_TRAIN_CONFIG_H
#define FSDP_TRAIN_CONFIG_H

#include "options.h"

/* argv with --config FILE's keys first, as flags, then argv[1..] (the command
 * line overrides the file); *nargv is argv itself without --config. A bad
 * file, an unknown key or a value of the wrong type is a usage error naming
 * the file and the key. Every rank reads the file alike. */
void config_argv(int argc, char **argv, int *nargc, char ***nargv);
/* Reads the JSON file path (a regular file of at most 1 MiB: --config, an
 * image model's --model-config) as one JSON value followed by nothing but
 * white space, as the library reads a GPT's model config: a NUL byte, a
 * second value or other bytes after it are refused (cJSON alone stops at
 * the end of the first value, or at a NUL). Returns the value, for the
 * caller to cJSON_Delete, or NULL with a message in err naming the byte
 * offset and its line (the caller names the flag and the file). */
struct cJSON *config_read_json(const char *path, char *err, size_t n);
/* Whether name ("--lr") is one of fsdp-train's flags that take a value or a
 * switch of the table, --config or --override. */
int config_flag_known(const char *name);
/* The resolved configuration, one JSON object keyed by the flags' long names
 * (null: unset); returned to the caller to free. */
char *config_json(const struct opts *o);
/* --resume: ck_json is the checkpoint's train_config ("" for a checkpoint
 * without one: nothing is restored). Every restored flag not named by
 * --override takes the checkpoint's value; one given in argv (the command
 * line or --config) with another value is an error naming both; then o is
 * parsed again from the checkpoint's values and argv. Returns the number of
 * flags taken from the checkpoint. Every rank computes the same. */
int config_resume(struct opts *o, int argc, char **argv, const char *ck_json, const char *ck_dir);
/* The tasks (task.h), for config_check_read. */
enum { TASK_TOKENS = 1, TASK_IMAGES = 2, TASK_SWAV = 4 };
/* Refuses a flag this run would not read ([Note: flags a run does not
 * read]): one given on the command line, or a --config key whose value is
 * not the flag's default, that the run's task (TASK_*) does not read or that
 * only other settings read (e.g. --momentum with --optim adamw): a usage
 * error naming the flag, where it came from and what reads it. A
 * checkpoint's restored flags are not checked (its run had this task). */
void config_check_read(const struct opts *o, int task);
/* The run is over: frees the argv config_argv and config_resume built (the
 * options and config_argv's *nargv point into them; neither is used after). */
void config_release(void);

#endif
