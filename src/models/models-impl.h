/*
 * models-impl.h - internal API of src/models (whole models built from
 * src/nn's layers: GPT, ResNet, SwAV's head): what the fuzz targets and tests
 * reach below the public header. The models' files include nn/nn-impl.h for
 * the layer constructors; nothing below src/models includes this header.
 */
#ifndef FSDP_MODELS_IMPL_H
#define FSDP_MODELS_IMPL_H

#include "core/core-impl.h"

/* ---- GPT (gpt.c) ---- */
/* fsdp_gpt_config_load on text[0..len) (need not be NUL-terminated) as if it
 * were the file `name`: the same checks and messages. For the fuzz targets. */
enum fsdp_status fsdp__gpt_config_parse(struct fsdp_ctx *ctx, const char *name, const char *text,
                                        size_t len, struct fsdp_gpt_config *cfg);

#endif
