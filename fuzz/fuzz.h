/*
 * fuzz.h - the libFuzzer entry point shared by the fuzz targets (fuzz/fuzz_*.c).
 * Each target's body is a static function fuzz_<target>_one(data, size) so the
 * corpus regression test (tests/test_readers.c) can replay the corpus through
 * exactly the code the fuzzer runs: it defines FUZZ_NO_MAIN and includes the
 * targets. Built by `make fuzz` (clang, -fsanitize=fuzzer,address,undefined).
 */
#ifndef FSDP_FUZZ_H
#define FSDP_FUZZ_H

#include <stddef.h>
#include <stdint.h>

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

/* Defines the entry point over a target's fuzz_<target>_one (its status is
 * for the corpus replay, not the fuzzer); nothing under FUZZ_NO_MAIN. */
#ifdef FUZZ_NO_MAIN
#define FUZZ_ENTRY(one)
#else
#define FUZZ_ENTRY(one)                                               \
    int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {    \
        (void)one(data, size);                                        \
        return 0;                                                     \
    }
#endif

/* A reader that refuses its input must say why (status st, context ctx). */
#define FUZZ_CHECK_REFUSAL(ctx, st) \
    FSDP_ASSERT(fsdp_errmsg(ctx)[0] != '\0', "failure (%s) without a message", fsdp_status_str(st))

#endif
