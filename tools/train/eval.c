/*
 * eval.c - how fsdp-train reports an evaluation (task.h's eval_*): the
 * held-out loss of every task, with the top-1 accuracy of a classifier (or
 * the task's own accuracy, e.g. SwAV's kNN) or the perplexity exp(loss) of a
 * text. The figures themselves come from the task's eval op.
 */
#include "task.h"

#include <math.h>
#include <stdio.h>

static const char *num(char *buf, size_t cap, double x) { /* JSON has no inf or nan */
    if (isfinite(x)) snprintf(buf, cap, "%.17g", x);
    else snprintf(buf, cap, "null");
    return buf;
}

void eval_print(const struct task *t, int step, int steps, const struct eval_result *e) {
    if (t->eval_ppl) printf("eval  %4d/%d  eval_loss %.4f  eval_ppl %.2f\n", step, steps, e->loss, exp(e->loss));
    else if (t->acc_name) printf("eval  %4d/%d  %s %.2f%%%s\n", step, steps, t->acc_name, 100.0 * e->acc, t->eval_note);
    else printf("eval  %4d/%d  eval_loss %.4f  eval_acc %.2f%%\n", step, steps, e->loss, 100.0 * e->acc);
}

void eval_log(FILE *f, const struct task *t, const struct eval_result *e) {
    char a[32], b[32];
    fprintf(f, "\"eval_loss\": %s, ", num(a, sizeof a, e->loss)); /* all 17 digits of the double */
    if (t->eval_ppl) fprintf(f, "\"eval_ppl\": %s, ", num(b, sizeof b, exp(e->loss)));
    else fprintf(f, "\"%s\": %s, ", t->acc_name ? t->acc_name : "eval_acc", num(b, sizeof b, e->acc));
    fprintf(f, "\"%s\": %lld, ", t->eval_count ? t->eval_count : "eval_images", (long long)e->count);
}

void eval_summary(const struct task *t, const struct eval_result *e) {
    if (t->eval_ppl)
        printf("eval: loss %.4f | perplexity %.2f (%lld held-out tokens)\n", e->loss, exp(e->loss),
               (long long)e->count);
    else if (t->acc_name)
        printf("eval: %s %.2f%% (%lld test images)%s\n", t->acc_name, 100.0 * e->acc, (long long)e->count,
               t->eval_note);
    else
        printf("eval: loss %.4f | top-1 accuracy %.2f%% (%lld test images)\n", e->loss, 100.0 * e->acc,
               (long long)e->count);
}
