/*
 * models-impl.h - internal API of src/models (whole models built from
 * src/nn's layers: ResNet, SwAV's head): what the fuzz targets and tests
 * reach below the public header.
 */
#ifndef FSDP_MODELS_IMPL_H
#define FSDP_MODELS_IMPL_H

#include "core/core-impl.h"

/* ---- ResNet (resnet.c) ---- */
/* Parses a ResNet model config from len bytes of JSON text (need not be
 * NUL-terminated) as fsdp_resnet_config_load does; messages name `path`.
 * *cfg is written only on success. */
enum fsdp_status fsdp__resnet_config_parse(struct fsdp_ctx *ctx, const char *path, const char *text, size_t len,
                                           struct fsdp_resnet_config *cfg);

#endif
