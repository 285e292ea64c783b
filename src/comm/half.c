/*
 * half.c - the backends' view of the 16-bit float types (bf16, fp16): their
 * low-precision reductions sum in fp32 and round once (see [Note:
 * low-precision reductions] in mpi.c). The conversions themselves are
 * src/core/dtype.c's (bit-exact, round to nearest even).
 */
#include "comm/comm-impl.h"

void fsdp__low_to_f32(const void *src, float *dst, size_t n, enum fsdp_dtype dt) {
    FSDP_ASSERT(fsdp__dtype_is_low(dt), "dtype %d is not a 16-bit float", (int)dt);
    fsdp__cvt_to_f32(dt, src, dst, n);
}

void fsdp__f32_to_low(const float *src, void *dst, size_t n, enum fsdp_dtype dt) {
    FSDP_ASSERT(fsdp__dtype_is_low(dt), "dtype %d is not a 16-bit float", (int)dt);
    fsdp__cvt_from_f32(dt, src, dst, n);
}

int fsdp__dtype_is_low(enum fsdp_dtype dt) { return dt == FSDP_BF16 || dt == FSDP_F16; }
