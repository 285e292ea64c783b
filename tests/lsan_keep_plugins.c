/*
 * lsan_keep_plugins.c - linked into every executable of the AddressSanitizer
 * build (make asan) and nowhere else: dlclose does nothing, so every shared
 * object stays loaded until the process exits.
 *
 * [Note: plugins kept loaded] Open MPI loads its components (mca_*.so) with
 * dlopen and unloads them at MPI_Finalize; the memory they keep until exit is
 * reported by LeakSanitizer at exit, and tests/lsan.supp names their modules
 * to suppress it. Unloaded, a plugin's frames name no module, and
 * LeakSanitizer's fast unwinder (frame pointers, which Debian's Open MPI is
 * built without) stops at the first of them, so nothing in the stack could be
 * matched. The suite used to record every allocation with the slow (DWARF)
 * unwinder 16 frames deep instead, to reach the MPI frames below: that took
 * about 45% of the sanitized scripts' time (tests/t_ckpt.sh 77 s against 133
 * on a 2-core VM). Kept loaded, the plugin's own module names its frame. The
 * definition in the executable comes before libc's in every lookup, so Open
 * MPI's dlclose calls land here.
 */
#include <dlfcn.h>

int dlclose(void *handle) {
    (void)handle;
    return 0;
}
