/*
 * fsdp-plot.c - draws the curves of fsdp-train --log files (JSON lines) as
 * one self-contained SVG: small-multiple panels of train and eval loss,
 * learning rate, gradient norm, throughput, peak memory and MFU against the
 * step (and the loss against tokens seen when the logs count them), each run
 * a colour, overlaid, with a legend of the file names. One of the programs in
 * tools/, the only code that prints and exits.
 *
 * A log line is a JSON object; the lines with a numeric "step" are steps,
 * others (a configuration line) are skipped; a null value (a skipped step's
 * loss) breaks the curve, and so does a configuration line after steps (a
 * resumed run appends its own to the log, then steps from its checkpoint's
 * on: each part is its own line, the later drawn over the earlier). Every panel states its mapping in data-*
 * attributes: the plot area in SVG units (data-x0 left, data-x1 right,
 * data-y0 top, data-y1 bottom) and the data range it spans (data-xmin,
 * data-xmax at x0, x1; data-ymin, data-ymax at y1, y0), so that a reader of
 * the rendered picture can check where the curves fall.
 *
 * The output is written to a temporary file beside it and renamed over it;
 * an existing -o must be a regular file that fsdp-plot wrote (the marker
 * comment on its second line), so nothing else is ever replaced.
 */
#include <cJSON.h>

#include <errno.h>
#include <fcntl.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "fsdp.h"

#define MARKER "<!-- fsdp-plot: curves of fsdp-train logs -->"

/* The series a log may hold, by its key. */
enum key { K_STEP, K_TOKENS, K_LOSS, K_EVAL_LOSS, K_LR, K_GRAD_NORM, K_TOK_S, K_IMG_S, K_PEAK, K_MFU, K_EVAL_ACC, K_N };
static const char *const key_names[K_N] = {"step",         "tokens",       "loss",        "eval_loss",
                                           "lr",           "grad_norm",    "tokens_per_s", "images_per_s",
                                           "peak_rss_mb",  "mfu",          "eval_acc"};

/* One run: n steps, each key's value per step (NAN: absent or null), and
 * whether a step is the first after a configuration line that follows steps. */
struct run {
    const char *path, *label;
    int n, cap;
    double *v[K_N];
    unsigned char *resumed;
};

/* A panel: y series (primary solid, secondary dashed with markers) against key x. */
struct panel_def {
    const char *title, *ylabel;
    enum key x, y1, y2; /* y2 = K_N: none */
};
static const struct panel_def panel_defs[] = {
    {"loss", "loss", K_STEP, K_LOSS, K_EVAL_LOSS},
    {"learning rate", "lr", K_STEP, K_LR, K_N},
    {"gradient norm", "grad_norm", K_STEP, K_GRAD_NORM, K_N},
    {"throughput", "tokens/s", K_STEP, K_TOK_S, K_N},
    {"throughput", "images/s", K_STEP, K_IMG_S, K_N},
    {"peak memory per rank (RSS)", "MB", K_STEP, K_PEAK, K_N},
    {"model FLOP utilisation", "mfu", K_STEP, K_MFU, K_N},
    {"eval accuracy", "eval_acc", K_STEP, K_EVAL_ACC, K_N},
    {"loss against tokens seen", "loss", K_TOKENS, K_LOSS, K_EVAL_LOSS},
};
#define N_PANEL_DEFS ((int)(sizeof panel_defs / sizeof panel_defs[0]))

static const char *const colors[] = {"#1f77b4", "#d62728", "#2ca02c", "#ff7f0e",
                                     "#9467bd", "#8c564b", "#e377c2", "#17becf"};
#define N_COLORS ((int)(sizeof colors / sizeof colors[0]))

/* Layout in SVG units (= CSS pixels at scale 1). */
enum { COLS = 2, PW = 380, PH = 200, ML = 72, MR = 24, MT = 34, MB = 46, CELL_W = ML + PW + MR, CELL_H = MT + PH + MB };

static const char *g_out_tmp; /* removed on a failure after it was created */

static _Noreturn void die(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
static _Noreturn void die(const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    fprintf(stderr, "fsdp-plot: ");
    vfprintf(stderr, fmt, ap);
    fprintf(stderr, "\n");
    va_end(ap);
    if (g_out_tmp) unlink(g_out_tmp);
    exit(1);
}

static void usage(FILE *f) {
    fprintf(f,
            "usage: fsdp-plot LOG.jsonl [LOG2.jsonl ...] -o CURVES.svg\n"
            "  Draws the --log files of fsdp-train (one JSON object per line) as one SVG: train and eval\n"
            "  loss, learning rate, gradient norm, throughput, peak memory and MFU against the step (and\n"
            "  the loss against tokens seen, when the logs count them); each file a colour, named in the\n"
            "  legend. A panel appears when some log has its field.\n"
            "  -o FILE   the SVG to write (replaced only if fsdp-plot wrote it)\n"
            "Exit status: 0 ok, 1 a bad log or output, 2 usage.\n");
}

static void run_push(struct run *r, const double *vals, int resumed) {
    if (r->n == r->cap) {
        r->cap = r->cap ? 2 * r->cap : 256;
        for (int k = 0; k < K_N; k++) {
            double *p = realloc(r->v[k], (size_t)r->cap * sizeof *p);
            if (!p) die("out of memory reading '%s'", r->path);
            r->v[k] = p;
        }
        unsigned char *q = realloc(r->resumed, (size_t)r->cap);
        if (!q) die("out of memory reading '%s'", r->path);
        r->resumed = q;
    }
    for (int k = 0; k < K_N; k++) r->v[k][r->n] = vals[k];
    r->resumed[r->n] = (unsigned char)resumed;
    r->n++;
}

static void read_log(struct run *r) {
    const char *kind;
    int fd = fsdp_open_regular(r->path, NULL, &kind); /* a FIFO is refused at once, not waited on */
    if (fd < 0 && kind && !strcmp(kind, "a directory")) die("'%s' is a folder, not a log file", r->path);
    if (fd < 0 && kind) die("'%s' is not a regular file (%s)", r->path, kind);
    if (fd < 0) die("cannot open '%s': %s", r->path, strerror(errno));
    FILE *f = fdopen(fd, "r");
    if (!f) die("cannot read '%s': %s", r->path, strerror(errno));
    char *line = NULL;
    size_t cap = 0;
    ssize_t len;
    long lineno = 0;
    int resumed = 0; /* a configuration line after steps: the next step starts a part */
    while ((len = getline(&line, &cap, f)) >= 0) {
        lineno++;
        if ((size_t)len != strlen(line)) die("%s:%ld: not a JSON object (holds a NUL byte)", r->path, lineno);
        const char *p = line;
        while (*p == ' ' || *p == '\t' || *p == '\r' || *p == '\n') p++;
        if (!*p) continue; /* a blank line */
        cJSON *o = cJSON_ParseWithOpts(line, NULL, 1); /* one object a line: nothing after it */
        if (!o || !cJSON_IsObject(o)) {
            cJSON_Delete(o);
            die("%s:%ld: not a JSON object%s", r->path, lineno, o ? "" : " (or more than one)");
        }
        cJSON *s = cJSON_GetObjectItemCaseSensitive(o, "step");
        if (cJSON_IsNumber(s)) {
            double vals[K_N];
            for (int k = 0; k < K_N; k++) {
                cJSON *it = cJSON_GetObjectItemCaseSensitive(o, key_names[k]);
                if (it && !cJSON_IsNumber(it) && !cJSON_IsNull(it)) { /* null: a value that was not finite */
                    cJSON_Delete(o);
                    die("%s:%ld: \"%s\" is not a number", r->path, lineno, key_names[k]);
                }
                vals[k] = cJSON_IsNumber(it) && isfinite(it->valuedouble) ? it->valuedouble : NAN;
            }
            run_push(r, vals, resumed);
            resumed = 0;
        } else if (s && !cJSON_IsNull(s)) {
            cJSON_Delete(o);
            die("%s:%ld: \"step\" is not a number", r->path, lineno);
        } else if (cJSON_GetObjectItemCaseSensitive(o, "config")) {
            resumed = r->n > 0;
        }
        cJSON_Delete(o);
    }
    int err = ferror(f);
    free(line);
    fclose(f);
    if (err) die("cannot read '%s'", r->path);
    if (r->n == 0) die("%s: no steps (no line with a \"step\"; fsdp-train --log writes one per step)", r->path);
}

/* ---- Axes: ranges rounded out to ticks at 1, 2 or 5 times a power of ten ---- */

struct axis {
    double lo, hi, step; /* lo and hi are multiples of step */
};
/* nice_axis gives 5 to 7 ticks; the tick loops stop here whatever the axis
 * ([Note: finite axes]) */
#define TICKS_MAX 64

/* [Note: finite axes] A span of denormals (0 and 5e-324) made the tick
 * step 0, one from -1e308 to 1e308 made it inf, and the tick loops never
 * ended. An axis spans at least AXIS_TINY, so that its step and ticks are
 * normal doubles (a narrower span is drawn as one value), and ends within
 * +-AXIS_HUGE, so that hi - lo and a value's place on the plot stay finite
 * (a value past it, a diverged loss, runs off the plot and is clipped). */
#define AXIS_TINY 1e-290
#define AXIS_HUGE 1e300

static void nice_axis(double lo, double hi, struct axis *a) {
    lo = fmin(fmax(lo, -AXIS_HUGE), AXIS_HUGE); /* also no value at all: lo +inf, hi -inf */
    hi = fmin(fmax(hi, -AXIS_HUGE), AXIS_HUGE);
    if (!(hi - lo >= AXIS_TINY)) { /* one value (or none): a range around it */
        double mid = lo <= hi ? lo / 2 + hi / 2 : 0, d = fabs(mid) * 0.1; /* lo > hi: no value */
        if (!(d >= AXIS_TINY)) d = 1.0;
        lo = mid - d;
        hi = mid + d;
    }
    double raw = (hi - lo) / 5.0, p = pow(10.0, floor(log10(raw))), f = raw / p;
    double step = (f <= 1.0 ? 1.0 : f <= 2.0 ? 2.0 : f <= 5.0 ? 5.0 : 10.0) * p;
    a->step = step;
    a->lo = floor(lo / step + 1e-9) * step;
    a->hi = ceil(hi / step - 1e-9) * step;
    if (a->hi <= a->lo) a->hi = a->lo + step;
}

/* A tick label: the fewest digits that tell ticks `step` apart; k/M/G above 10^4. */
static void tick_label(char *buf, size_t cap, double v, double step) {
    if (fabs(v) < step * 1e-6) {
        snprintf(buf, cap, "0");
        return;
    }
    const char *suf = "";
    double av = fabs(v) > fabs(step) ? fabs(v) : fabs(step);
    if (av >= 1e15) { /* up to 1e300 ([Note: finite axes]): its fixed digits would not fit buf */
        int sig = (int)(floor(log10(av)) - floor(log10(step)));
        snprintf(buf, cap, "%.*e", sig < 0 ? 0 : sig > 16 ? 16 : sig, v);
        return;
    }
    if (av >= 1e4) {
        double d = av >= 1e9 ? 1e9 : av >= 1e6 ? 1e6 : 1e3;
        suf = d == 1e9 ? "G" : d == 1e6 ? "M" : "k";
        v /= d;
        step /= d;
    }
    int dec = step >= 1 ? 0 : (int)ceil(-log10(step) - 1e-9);
    if (dec <= 6) snprintf(buf, cap, "%.*f%s", dec, v, suf);
    else snprintf(buf, cap, "%.2g%s", v, suf);
}

/* XML text: & < > " escaped. */
static void xml_text(FILE *f, const char *s) {
    for (; *s; s++) {
        switch (*s) {
        case '&': fputs("&amp;", f); break;
        case '<': fputs("&lt;", f); break;
        case '>': fputs("&gt;", f); break;
        case '"': fputs("&quot;", f); break;
        default:
            if ((unsigned char)*s >= 0x20 || *s == '\t') fputc(*s, f);
        }
    }
}

static int has_any(const struct run *runs, int nr, enum key k) {
    for (int i = 0; i < nr; i++)
        for (int j = 0; j < runs[i].n; j++)
            if (!isnan(runs[i].v[k][j])) return 1;
    return 0;
}

/* The range of key k over the runs' steps at which key `with` is also present. */
static void range_of(const struct run *runs, int nr, enum key k, enum key with, double *lo, double *hi) {
    for (int i = 0; i < nr; i++)
        for (int j = 0; j < runs[i].n; j++) {
            double v = runs[i].v[k][j];
            if (isnan(v) || (with != K_N && isnan(runs[i].v[with][j]))) continue;
            if (v < *lo) *lo = v;
            if (v > *hi) *hi = v;
        }
}

/* One series of one run: polylines broken at absent values (dashed: joined
 * across them, for sparse series such as eval_loss) and, every series, where
 * a resumed part starts; markers when sparse. */
static void draw_series(FILE *f, const struct run *r, enum key xk, enum key yk, const char *color, int dashed,
                        double x0, double x1, double y0, double y1, const struct axis *ax, const struct axis *ay) {
    int open = 0, npts = 0;
    for (int j = 0; j < r->n; j++) {
        double x = r->v[xk][j], y = r->v[yk][j];
        if (open && r->resumed[j]) {
            fputs("\"/>\n", f);
            open = 0;
        }
        if (isnan(x) || isnan(y)) {
            if (open && !dashed) {
                fputs("\"/>\n", f);
                open = 0;
            }
            continue;
        }
        double px = x0 + (x - ax->lo) / (ax->hi - ax->lo) * (x1 - x0);
        double py = y1 - (y - ay->lo) / (ay->hi - ay->lo) * (y1 - y0);
        if (!open) {
            fprintf(f, "<polyline class=\"curve\" data-series=\"%s\" fill=\"none\" stroke=\"%s\" stroke-width=\"1.6\" "
                    "stroke-linejoin=\"round\"%s points=\"", key_names[yk], color,
                    dashed ? " stroke-dasharray=\"6 4\"" : "");
            open = 1;
        }
        fprintf(f, "%.2f,%.2f ", px, py);
        npts++;
    }
    if (open) fputs("\"/>\n", f);
    if (!dashed && npts > 1) return;
    for (int j = 0; j < r->n; j++) { /* markers: eval points, or a lone point */
        double x = r->v[xk][j], y = r->v[yk][j];
        if (isnan(x) || isnan(y)) continue;
        fprintf(f, "<circle cx=\"%.2f\" cy=\"%.2f\" r=\"2.5\" fill=\"%s\"/>\n",
                x0 + (x - ax->lo) / (ax->hi - ax->lo) * (x1 - x0), y1 - (y - ay->lo) / (ay->hi - ay->lo) * (y1 - y0),
                color);
    }
}

static void draw_panel(FILE *f, const struct panel_def *d, const struct run *runs, int nr, double ox, double oy) {
    double xlo = INFINITY, xhi = -INFINITY, ylo = INFINITY, yhi = -INFINITY;
    range_of(runs, nr, d->x, d->y1, &xlo, &xhi);
    range_of(runs, nr, d->y1, d->x, &ylo, &yhi);
    if (d->y2 != K_N) {
        range_of(runs, nr, d->x, d->y2, &xlo, &xhi);
        range_of(runs, nr, d->y2, d->x, &ylo, &yhi);
    }
    struct axis ax, ay;
    nice_axis(xlo, xhi, &ax);
    nice_axis(ylo, yhi, &ay);
    double x0 = ox + ML, x1 = x0 + PW, y0 = oy + MT, y1 = y0 + PH;
    fprintf(f, "<g class=\"panel\" data-field=\"%s\" data-xfield=\"%s\" data-x0=\"%.2f\" data-x1=\"%.2f\" "
            "data-y0=\"%.2f\" data-y1=\"%.2f\" data-xmin=\"%.17g\" data-xmax=\"%.17g\" data-ymin=\"%.17g\" "
            "data-ymax=\"%.17g\">\n", key_names[d->y1], key_names[d->x], x0, x1, y0, y1, ax.lo, ax.hi, ay.lo, ay.hi);
    fprintf(f, "<text class=\"title\" x=\"%.1f\" y=\"%.1f\">", x0, y0 - 12);
    xml_text(f, d->title);
    if (d->y2 != K_N && has_any(runs, nr, d->y2)) fprintf(f, " (%s solid, %s dashed)", key_names[d->y1], key_names[d->y2]);
    fputs("</text>\n", f);
    /* grid and ticks */
    char lab[64];
    for (int i = 0; i <= TICKS_MAX; i++) {
        double v = ax.lo + i * ax.step;
        if (v > ax.hi + ax.step * 1e-6) break;
        double px = x0 + (v - ax.lo) / (ax.hi - ax.lo) * PW;
        tick_label(lab, sizeof lab, v, ax.step);
        fprintf(f, "<line class=\"grid\" x1=\"%.2f\" y1=\"%.2f\" x2=\"%.2f\" y2=\"%.2f\"/>", px, y0, px, y1);
        fprintf(f, "<line class=\"tick\" x1=\"%.2f\" y1=\"%.2f\" x2=\"%.2f\" y2=\"%.2f\"/>", px, y1, px, y1 + 5);
        fprintf(f, "<text class=\"xt\" x=\"%.2f\" y=\"%.2f\">%s</text>\n", px, y1 + 18, lab);
    }
    for (int i = 0; i <= TICKS_MAX; i++) {
        double v = ay.lo + i * ay.step;
        if (v > ay.hi + ay.step * 1e-6) break;
        double py = y1 - (v - ay.lo) / (ay.hi - ay.lo) * PH;
        tick_label(lab, sizeof lab, v, ay.step);
        fprintf(f, "<line class=\"grid\" x1=\"%.2f\" y1=\"%.2f\" x2=\"%.2f\" y2=\"%.2f\"/>", x0, py, x1, py);
        fprintf(f, "<line class=\"tick\" x1=\"%.2f\" y1=\"%.2f\" x2=\"%.2f\" y2=\"%.2f\"/>", x0 - 5, py, x0, py);
        fprintf(f, "<text class=\"yt\" x=\"%.2f\" y=\"%.2f\">%s</text>\n", x0 - 8, py + 4, lab);
    }
    fprintf(f, "<rect class=\"frame\" x=\"%.2f\" y=\"%.2f\" width=\"%d\" height=\"%d\"/>\n", x0, y0, PW, PH);
    fprintf(f, "<text class=\"xl\" x=\"%.2f\" y=\"%.2f\">%s</text>\n", (x0 + x1) / 2, y1 + 38, key_names[d->x]);
    fprintf(f, "<text class=\"yl\" transform=\"translate(%.2f %.2f) rotate(-90)\">", ox + 14, (y0 + y1) / 2);
    xml_text(f, d->ylabel);
    fputs("</text>\n", f);
    /* the curves, clipped to the plot area */
    fprintf(f, "<clipPath id=\"c%.0f_%.0f\"><rect x=\"%.2f\" y=\"%.2f\" width=\"%d\" height=\"%d\"/></clipPath>\n", ox,
            oy, x0 - 2, y0 - 2, PW + 4, PH + 4);
    fprintf(f, "<g clip-path=\"url(#c%.0f_%.0f)\">\n", ox, oy);
    for (int i = 0; i < nr; i++) {
        const char *c = colors[i % N_COLORS];
        draw_series(f, &runs[i], d->x, d->y1, c, 0, x0, x1, y0, y1, &ax, &ay);
        if (d->y2 != K_N) draw_series(f, &runs[i], d->x, d->y2, c, 1, x0, x1, y0, y1, &ax, &ay);
    }
    fputs("</g>\n</g>\n", f);
}

/* -o: absent, or a regular file whose second line is our marker. */
static void check_out(const char *path) {
    struct stat sb;
    if (lstat(path, &sb) != 0) {
        if (errno == ENOENT) return;
        die("-o '%s': %s", path, strerror(errno));
    }
    if (!S_ISREG(sb.st_mode)) die("-o '%s' exists and is not a regular file; give another name", path);
    FILE *f = fopen(path, "r");
    char head[256] = "", mark[256] = "";
    if (!f) die("-o '%s': cannot read it: %s", path, strerror(errno));
    int ok = fgets(head, sizeof head, f) && fgets(mark, sizeof mark, f) && !strncmp(mark, MARKER, strlen(MARKER));
    fclose(f);
    if (!ok) die("-o '%s' exists and was not written by fsdp-plot; remove it or give another name", path);
}

int main(int argc, char **argv) {
    const char *out = NULL;
    struct run *runs = calloc((size_t)argc, sizeof *runs);
    int nr = 0;
    if (!runs) die("out of memory");
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--help") || !strcmp(argv[i], "-h")) {
            usage(stdout);
            free(runs);
            return 0;
        } else if (!strcmp(argv[i], "-o") || !strcmp(argv[i], "--output")) {
            if (i + 1 >= argc || !argv[i + 1][0]) {
                fprintf(stderr, "fsdp-plot: %s needs a file name%s\n", argv[i], i + 1 < argc ? " (it is empty)" : "");
                free(runs);
                return 2;
            }
            out = argv[++i];
        } else if (argv[i][0] == '-' && argv[i][1]) {
            fprintf(stderr, "fsdp-plot: unknown option '%s' (see --help)\n", argv[i]);
            free(runs);
            return 2;
        } else runs[nr++].path = argv[i];
    }
    if (!nr || !out) {
        usage(stderr);
        free(runs);
        return 2;
    }
    check_out(out);
    for (int i = 0; i < nr; i++) {
        read_log(&runs[i]);
        const char *b = strrchr(runs[i].path, '/');
        runs[i].label = b && b[1] ? b + 1 : runs[i].path;
    }
    for (int i = 0; i < nr; i++) /* two files of one name: their paths as given */
        for (int j = 0; j < nr; j++)
            if (i != j && !strcmp(runs[i].label, runs[j].label)) runs[i].label = runs[i].path;

    int shown[N_PANEL_DEFS], np = 0;
    for (int p = 0; p < N_PANEL_DEFS; p++) {
        const struct panel_def *d = &panel_defs[p];
        if (has_any(runs, nr, d->x) && (has_any(runs, nr, d->y1) || (d->y2 != K_N && has_any(runs, nr, d->y2))))
            shown[np++] = p;
    }
    int legend_h = 30 + 18 * nr;
    int rows = (np + COLS - 1) / COLS, width = COLS * CELL_W + 20, height = legend_h + rows * CELL_H + 10;

    char tmp[4096];
    if (snprintf(tmp, sizeof tmp, "%s.tmp.XXXXXX", out) >= (int)sizeof tmp) die("-o '%s': name too long", out);
    int fd = mkstemp(tmp);
    if (fd < 0) die("-o '%s': cannot create a file beside it: %s", out, strerror(errno));
    g_out_tmp = tmp;
    FILE *f = fdopen(fd, "w");
    if (!f) die("-o '%s': %s", out, strerror(errno));
    fprintf(f, "<?xml version=\"1.0\" encoding=\"UTF-8\"?>\n" MARKER "\n");
    fprintf(f, "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"%d\" height=\"%d\" viewBox=\"0 0 %d %d\">\n", width,
            height, width, height);
    fputs("<style>text{font-family:sans-serif;font-size:12px;fill:#222}.title{font-size:13px;font-weight:bold}"
          ".xt,.xl{text-anchor:middle}.yt{text-anchor:end}.yl{text-anchor:middle}"
          ".grid{stroke:#e4e4e4;stroke-width:1}.tick{stroke:#444;stroke-width:1}"
          ".frame{fill:none;stroke:#444;stroke-width:1}</style>\n", f);
    fprintf(f, "<rect width=\"%d\" height=\"%d\" fill=\"#ffffff\"/>\n", width, height);
    fprintf(f, "<g class=\"legend\">\n<text class=\"title\" x=\"20\" y=\"20\">%d run%s</text>\n", nr, nr == 1 ? "" : "s");
    for (int i = 0; i < nr; i++) {
        int y = 34 + 18 * i;
        fprintf(f, "<line x1=\"20\" y1=\"%d\" x2=\"44\" y2=\"%d\" stroke=\"%s\" stroke-width=\"3\"/>", y, y,
                colors[i % N_COLORS]);
        fprintf(f, "<text class=\"run\" data-color=\"%s\" x=\"52\" y=\"%d\">", colors[i % N_COLORS], y + 4);
        xml_text(f, runs[i].label);
        fprintf(f, " (%d steps)</text>\n", runs[i].n);
    }
    fputs("</g>\n", f);
    for (int i = 0; i < np; i++)
        draw_panel(f, &panel_defs[shown[i]], runs, nr, 10 + (i % COLS) * CELL_W, legend_h + (i / COLS) * CELL_H);
    fputs("</svg>\n", f);
    if (fflush(f) != 0 || fsync(fd) != 0 || ferror(f)) die("-o '%s': write failed: %s", out, strerror(errno));
    if (fclose(f) != 0) die("-o '%s': write failed: %s", out, strerror(errno));
    mode_t um = umask(0);
    umask(um);
    if (chmod(tmp, 0666 & ~um) != 0) { /* mkstemp's 0600 is only less readable */ }
    check_out(out); /* nothing else took the name meanwhile */
    if (rename(tmp, out) != 0) die("-o '%s': cannot rename '%s' to it: %s", out, tmp, strerror(errno));
    g_out_tmp = NULL;
    printf("wrote %s: %d panel%s, %d run%s\n", out, np, np == 1 ? "" : "s", nr, nr == 1 ? "" : "s");
    for (int i = 0; i < nr; i++) {
        for (int k = 0; k < K_N; k++) free(runs[i].v[k]);
        free(runs[i].resumed);
    }
    free(runs);
    return 0;
}
