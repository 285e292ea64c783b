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

#endif
