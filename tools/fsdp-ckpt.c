/*
 * fsdp-ckpt.c - inspects and converts checkpoints offline (no MPI; a model
 * config only to check and record what to-sharded converts):
 * lists a sharded checkpoint folder or a safetensors file, verifies every
 * checksum and range, and converts sharded <-> full. One of the programs in
 * tools/, the only code that prints and exits.
 */
#include "fsdp.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static void usage(FILE *f) {
    fprintf(f,
            "usage: fsdp-ckpt COMMAND ...\n"
            "  list PATH                 contents of a sharded checkpoint folder or a safetensors file\n"
            "  verify PATH               list, then read everything and check every checksum and range\n"
            "  to-full DIR FILE          sharded folder -> one safetensors file of the parameters\n"
            "  to-sharded FILE DIR [N] [--model NAME | --model-config FILE]\n"
            "                            safetensors file (ours, any F32 file with our FQNs, or Hugging\n"
            "                            Face GPT-2) -> sharded folder of N files (default 1), loadable\n"
            "                            with fsdp-train --resume at any world size (no optimizer\n"
            "                            state). With a model, the file must hold exactly its\n"
            "                            parameters, and the folder records it: --resume then needs\n"
            "                            no model flags\n"
            "Exit status: 0 ok, 1 a bad or unreadable checkpoint, 2 usage.\n");
}

int main(int argc, char **argv) {
    int help = 0; /* anywhere: `fsdp-ckpt list --help` read --help as a path */
    for (int i = 1; i < argc; i++) help |= !strcmp(argv[i], "--help") || !strcmp(argv[i], "-h");
    if (argc < 2 || help) {
        usage(argc < 2 ? stderr : stdout);
        return argc < 2 ? 2 : 0;
    }
    char env_msg[768];
    if (fsdp_env_check(env_msg, sizeof env_msg) != FSDP_OK) {
        fprintf(stderr, "fsdp-ckpt: error: %s\n", env_msg);
        return 2;
    }
    struct fsdp_ctx_opts co = fsdp_ctx_opts_default();
    co.comm = FSDP_COMM_SELF;
    co.threads = 1;
    struct fsdp_ctx *ctx;
    if (fsdp_ctx_create(&co, &ctx) != FSDP_OK) {
        fprintf(stderr, "fsdp-ckpt: cannot create a context\n");
        return 1;
    }
    const char *cmd = argv[1];
    enum fsdp_status st;
    if ((!strcmp(cmd, "list") || !strcmp(cmd, "verify")) && argc == 3) {
        st = fsdp_ckpt_describe(ctx, argv[2], !strcmp(cmd, "verify"), stdout);
    } else if (!strcmp(cmd, "to-full") && argc == 4) {
        st = fsdp_ckpt_to_full(ctx, argv[2], argv[3]);
        if (st == FSDP_OK) printf("wrote %s\n", argv[3]);
    } else if (!strcmp(cmd, "to-sharded") && argc >= 4 && argc <= 7) {
        /* optional N, then optional --model NAME | --model-config FILE */
        int na = argc >= 5 && strncmp(argv[4], "--", 2) ? 5 : 4;
        const char *flag = na < argc ? argv[na] : NULL, *arg = na + 1 < argc ? argv[na + 1] : NULL;
        char *end = NULL;
        long n = na == 5 ? strtol(argv[4], &end, 10) : 1;
        if (na == 5 && (*end || n < 1 || n > 4096)) {
            fprintf(stderr, "fsdp-ckpt: to-sharded: N '%s' is not an integer in [1, 4096]\n", argv[4]);
            fsdp_ctx_free(ctx);
            return 2;
        }
        if (flag && (!arg || na + 2 != argc || (strcmp(flag, "--model") && strcmp(flag, "--model-config")))) {
            fprintf(stderr, "fsdp-ckpt: to-sharded: expected --model NAME or --model-config FILE after DIR [N]\n");
            fsdp_ctx_free(ctx);
            return 2;
        }
        struct fsdp_gpt_config cfg;
        st = FSDP_OK;
        if (flag && !strcmp(flag, "--model") && fsdp_gpt_config_preset(arg, &cfg) != FSDP_OK) {
            fprintf(stderr, "fsdp-ckpt: --model: unknown preset '%s' (tiny, small, gpt2, gpt2-medium, gpt2-large, "
                            "gpt2-xl)\n", arg);
            fsdp_ctx_free(ctx);
            return 2;
        }
        if (flag && !strcmp(flag, "--model-config") && (st = fsdp_gpt_config_load(ctx, arg, &cfg)) != FSDP_OK) {
            fprintf(stderr, "fsdp-ckpt: error: %s %s: %s\n", flag, arg, fsdp_errmsg(ctx));
            fsdp_ctx_free(ctx);
            return 1;
        }
        st = fsdp_ckpt_from_full_model(ctx, argv[2], argv[3], (int)n, flag ? &cfg : NULL);
        if (st == FSDP_OK) printf("wrote %s (%ld files%s%s)\n", argv[3], n, flag ? ", model " : "", flag ? arg : "");
        if (st != FSDP_OK && flag) { /* the file's or the folder's error, or the model's: the model named after */
            fprintf(stderr, "fsdp-ckpt: error: %s (to-sharded with %s %s)\n", fsdp_errmsg(ctx), flag, arg);
            fsdp_ctx_free(ctx);
            return 1;
        }
    } else { /* what is wrong: the command, or its arguments */
        int known = !strcmp(cmd, "list") || !strcmp(cmd, "verify") || !strcmp(cmd, "to-full") || !strcmp(cmd, "to-sharded");
        const char *want = !strcmp(cmd, "to-full") ? "DIR OUT.safetensors" : !strcmp(cmd, "to-sharded")
                           ? "FULL.safetensors DIR [N] [--model NAME | --model-config FILE]" : "PATH";
        if (!known) fprintf(stderr, "fsdp-ckpt: unknown command '%s' (list, verify, to-full, to-sharded)\n", cmd);
        else fprintf(stderr, "fsdp-ckpt: %s takes %s; %d argument%s given\n", cmd, want, argc - 2, argc == 3 ? "" : "s");
        usage(stderr);
        fsdp_ctx_free(ctx);
        return 2;
    }
    if (st != FSDP_OK) fprintf(stderr, "fsdp-ckpt: error: %s\n", fsdp_errmsg(ctx));
    fsdp_ctx_free(ctx);
    return st == FSDP_OK ? 0 : 1;
}
