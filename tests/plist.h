/*
 * plist.h - a module tree's parameters (collect_param) and buffers
 * (collect_buffer) in definition order, in arrays that grow as they fill:
 *     struct plist pl = {0};
 *     fsdp_module_foreach_param(m, collect_param, &pl);
 *     ... pl.p[0 .. pl.n) ...
 *     plist_free(&pl);
 * Include after fsdp.h.
 */
#ifndef FSDP_TEST_PLIST_H
#define FSDP_TEST_PLIST_H

#include <stdlib.h>

struct plist {
    int n;
    struct fsdp_param **p;
};
struct blist {
    int n;
    struct fsdp_buffer **b;
};

/* a, holding n elements of size sz, with room for one more: the capacity
 * doubles whenever n reaches a power of two (1, 2, 4, ...); aborts when
 * memory runs out */
static inline void *plist_grow(void *a, int n, size_t sz) {
    if (n & (n - 1)) return a;
    void *g = realloc(a, (size_t)(n ? 2 * n : 1) * sz);
    if (!g) abort();
    return g;
}
static inline int collect_param(struct fsdp_param *p, void *ud) {
    struct plist *l = ud;
    l->p = plist_grow(l->p, l->n, sizeof *l->p);
    l->p[l->n++] = p;
    return 0;
}
static inline int collect_buffer(struct fsdp_buffer *b, void *ud) {
    struct blist *l = ud;
    l->b = plist_grow(l->b, l->n, sizeof *l->b);
    l->b[l->n++] = b;
    return 0;
}
static inline void plist_free(struct plist *l) {
    free(l->p);
    *l = (struct plist){0};
}
static inline void blist_free(struct blist *l) {
    free(l->b);
    *l = (struct blist){0};
}

#endif
