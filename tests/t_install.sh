#!/usr/bin/env bash
# t_install.sh - `make install` into a staging directory gives a header, the
# libraries and a pkg-config file with which a C program builds and runs.
# Prints "N passed, N failed".
. "$(dirname "$0")/lib.sh"

if make -s BUILD="$BUILD" install PREFIX="$tmp/prefix" > "$tmp/log" 2>&1; then ok "make install"
else bad "make install" "$(tail -5 "$tmp/log")"; fi
for f in include/fsdp.h lib/libfsdp.a lib/libfsdp.so lib/pkgconfig/fsdp.pc bin/fsdp-train bin/fsdp-plot; do
  [ -e "$tmp/prefix/$f" ] && ok "installed $f" || bad "installed $f"
done
cat > "$tmp/prog.c" <<'C'
#include <fsdp.h>
#include <stdio.h>
int main(void) {
    struct fsdp_ctx_opts o = fsdp_ctx_opts_default();
    o.comm = FSDP_COMM_SELF;
    struct fsdp_ctx *ctx;
    if (fsdp_ctx_create(&o, &ctx) != FSDP_OK) return 1;
    struct fsdp_gpt_config cfg;
    struct fsdp_module *gpt;
    if (fsdp_gpt_config_preset("tiny", &cfg) != FSDP_OK || fsdp_gpt_create(ctx, &cfg, &gpt) != FSDP_OK) return 1;
    printf("params %lld\n", (long long)fsdp_module_numel(gpt));
    fsdp_module_free(gpt);
    fsdp_ctx_free(ctx);
    return 0;
}
C
export PKG_CONFIG_PATH="$tmp/prefix/lib/pkgconfig"
# a sanitized library needs the sanitizer runtime in the program too
case "$BUILD" in
  *asan*) san="-fsanitize=address,undefined" ;;
  *ubsan*) san="-fsanitize=undefined" ;;
  *) san="" ;;
esac
if cc $san -o "$tmp/prog" "$tmp/prog.c" $(pkg-config --cflags fsdp) $(pkg-config --libs --static fsdp) > "$tmp/cc" 2>&1 \
   && out=$(LD_LIBRARY_PATH="$tmp/prefix/lib" "$tmp/prog") && [[ "$out" == params* ]]; then
  ok "a program builds with pkg-config fsdp and runs ($out)"
else bad "a program builds with pkg-config fsdp and runs" "$(tail -5 "$tmp/cc")"; fi
finish
