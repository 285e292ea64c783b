/*
 * json.c - the strict reading of a JSON file's text (the model configs of
 * src/models): exactly one JSON value, then nothing but JSON white space.
 * cJSON stops at the end of the first value and at a NUL byte, so without
 * this check `{...} junk`, a second object or `{...}\0anything` would load as
 * the first object alone; each is refused naming the file and the byte.
 */
#include "io/io-impl.h"

#include <cJSON.h>
#include <string.h>

enum fsdp_status fsdp__json_parse(struct fsdp_ctx *ctx, const char *what, const char *name, const char *text,
                                  size_t len, cJSON **out) {
    *out = NULL;
    size_t nul = strnlen(text, len); /* the text ends at the first NUL for cJSON */
    if (nul < len)
        return fsdp__err(ctx, FSDP_ERR_FORMAT, "%s '%s': a NUL byte at byte %zu (the file is %zu bytes of text)",
                         what, name, nul, len);
    const char *end = NULL;
    long failures = fsdp__alloc_failures;
    cJSON *root = cJSON_ParseWithLengthOpts(text, len, &end, 0);
    if (!root && fsdp__alloc_failures != failures)
        return fsdp__err(ctx, FSDP_ERR_NOMEM, "%s '%s': out of memory for its JSON", what, name);
    if (!root) {
        const char *at = cJSON_GetErrorPtr();
        return fsdp__err(ctx, FSDP_ERR_FORMAT, "%s '%s': invalid JSON near byte %lld", what, name,
                         at && at >= text && at <= text + len ? (long long)(at - text) : -1LL);
    }
    while (end < text + len && (*end == ' ' || *end == '\t' || *end == '\n' || *end == '\r')) end++;
    if (end < text + len) {
        cJSON_Delete(root);
        return fsdp__err(ctx, FSDP_ERR_FORMAT, "%s '%s': bytes after the JSON value at byte %lld (one value per file)",
                         what, name, (long long)(end - text));
    }
    *out = root;
    return FSDP_OK;
}
