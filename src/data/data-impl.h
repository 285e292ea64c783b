/*
 * data-impl.h - internal API of src/data: the image-set reader's entry point
 * from memory, so that the fuzz target (fuzz/fuzz_idx.c) and the corpus
 * replay (tests/test_idx.c) reach exactly the validation code the file
 * reader runs. Anything here is not API.
 */
#ifndef FSDP_DATA_IMPL_H
#define FSDP_DATA_IMPL_H

#include "core/core-impl.h"

/* ---- IDX image sets (idx.c) ---- */
/* fsdp_images_open_idx on the bytes of the two files (each plain or gzip'd,
 * [Note: IDX bytes]) as if they were the files images_name and labels_name:
 * the same checks and messages. The buffers are borrowed for the call. *out
 * is returned to the caller to free with fsdp_images_free. COLLECTIVE: no. */
enum fsdp_status fsdp__images_open_mem(struct fsdp_ctx *ctx, const char *images_name, const void *images,
                                       size_t images_len, const char *labels_name, const void *labels,
                                       size_t labels_len, int num_classes, struct fsdp_images **out);

/* The same for the raw format ([Note: raw image format] in idx.c) on the
 * bytes of one file (plain or gzip'd) named `name`. */
enum fsdp_status fsdp__images_open_raw_mem(struct fsdp_ctx *ctx, const char *name, const void *data, size_t len,
                                           int num_classes, struct fsdp_images **out);

#endif
