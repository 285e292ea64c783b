/*
 * fuzz_config.c - libFuzzer target for the JSON model-config readers: the
 * GPT's (fsdp_gpt_config_load through fsdp__gpt_config_parse) and the
 * ResNet's (fsdp_resnet_config_load through fsdp_resnet_config_parse), each
 * given every input. On success the config must pass its validator; on
 * failure a message must name the problem.
 */
#include "fuzz.h"
#include "models/models-impl.h"

/* Returns the reader's status (FSDP_ERR_NOMEM if no context could be made). */
static enum fsdp_status fuzz_config_one(const uint8_t *data, size_t size) {
    struct fsdp_ctx *ctx;
    if (fsdp__ctx_alloc(&ctx) != FSDP_OK) return FSDP_ERR_NOMEM;
    struct fsdp_gpt_config cfg = {0, 0, 0, 0, 0};
    enum fsdp_status st = fsdp__gpt_config_parse(ctx, "fuzz.json", (const char *)data, size, &cfg);
    if (st == FSDP_OK)
        FSDP_ASSERT(fsdp_gpt_config_validate(ctx, &cfg) == FSDP_OK, "accepted an invalid config: %s",
                    fsdp_errmsg(ctx));
    else
        FUZZ_CHECK_REFUSAL(ctx, st);
    struct fsdp_resnet_config rc;
    enum fsdp_status rs = fsdp_resnet_config_parse(ctx, "fuzz.json", (const char *)data, size, &rc);
    if (rs == FSDP_OK)
        FSDP_ASSERT(fsdp_resnet_config_validate(ctx, &rc) == FSDP_OK, "accepted an invalid ResNet config: %s",
                    fsdp_errmsg(ctx));
    else
        FUZZ_CHECK_REFUSAL(ctx, rs);
    fsdp__ctx_release(ctx);
    return st == FSDP_OK ? st : rs;
}

FUZZ_ENTRY(fuzz_config_one)
