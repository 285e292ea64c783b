/*
 * fuzz_idx.c - libFuzzer target for the IDX image-set reader
 * (fsdp_images_open_idx through fsdp__images_open_mem): plain and gzip'd
 * image and label files, and the raw format's reader
 * (fsdp__images_open_raw_mem). Input: byte 0 picks num_classes (bits 0-2)
 * and the raw format (bit 7); for IDX, bytes 1-2 (little endian) are the
 * length of the image file, which follows, and the rest is the label file;
 * for the raw format bytes 3.. are the file. On success every label is below num_classes and an augmented,
 * shuffled batch stays finite and inside the set.
 */
#include "data/data-impl.h"
#include "fuzz.h"

#include <math.h>
#include <string.h>

/* Returns the reader's status (FSDP_ERR_NOMEM if no context could be made). */
static enum fsdp_status fuzz_idx_one(const uint8_t *data, size_t size) {
    if (size < 3) return FSDP_ERR_INVALID;
    static const int classes[8] = {1, 2, 3, 9, 10, 100, 255, 256};
    int nc = classes[data[0] & 7];
    size_t ilen = (size_t)data[1] | (size_t)data[2] << 8;
    if (ilen > size - 3) ilen = size - 3;
    const uint8_t *img = data + 3, *lab = img + ilen;
    size_t llen = size - 3 - ilen;
    struct fsdp_ctx *ctx;
    if (fsdp__ctx_alloc(&ctx) != FSDP_OK) return FSDP_ERR_NOMEM;
    struct fsdp_images *im = NULL;
    /* byte 0's high bit: the raw format (fsdp_images_open_raw), the whole rest one file */
    enum fsdp_status st = data[0] & 0x80
                              ? fsdp__images_open_raw_mem(ctx, "fuzz-raw", data + 3, size - 3, nc, &im)
                              : fsdp__images_open_mem(ctx, "fuzz-images", img, ilen, "fuzz-labels", lab, llen, nc, &im);
    if (st == FSDP_OK) {
        struct fsdp_images_info info;
        fsdp_images_info(im, &info);
        FSDP_ASSERT(info.count >= 1 && info.channels >= 1 && info.channels <= 4, "bad set shape");
        for (int64_t i = 0; i < info.count; i++)
            FSDP_ASSERT(fsdp_images_label(im, i) >= 0 && fsdp_images_label(im, i) < nc, "label out of range");
        int64_t per = (int64_t)info.channels * info.height * info.width;
        if (per <= 4096) {
            struct fsdp_image_batch_opts o = fsdp_image_batch_opts_default();
            o.crop_padding = 2;
            o.hflip = 1;
            float *x = malloc((size_t)(3 * per) * sizeof(float));
            int32_t y[3];
            if (x && fsdp_images_batch(ctx, im, &o, 1, 3, 0, 1, x, y) == FSDP_OK)
                for (int64_t i = 0; i < 3 * per; i++) FSDP_ASSERT(isfinite(x[i]), "non-finite pixel");
            free(x);
        }
    } else {
        FSDP_ASSERT(im == NULL, "failed open returned a set");
        FUZZ_CHECK_REFUSAL(ctx, st);
    }
    fsdp_images_free(im);
    fsdp__ctx_release(ctx);
    return st;
}

FUZZ_ENTRY(fuzz_idx_one)
