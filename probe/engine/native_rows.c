/* attnprobe's native row pass (probe/engine/native_rows.py builds and loads it; probe/engine/stats.py calls it).

   For each of R rows of K base-2 logits s (-inf where the row may not attend), n rows per head, in one call:
     max_out    the row's largest logit                      arg_out    the first key holding it
     e          exp2(s - shift) written out, shift = the given per-row shift (the kernel's lse), or the row's max
                (0 when the max is -inf)
     sum_out    sum e                                        min_out    min e
     dot_out    sum e * (s - shift) over the keys where e > 0 (forbidden keys and underflow count 0)
     scale_out  sum e * vmax, vmax the head's largest |v| per key (0 without vmax)
     finite_out the keys whose logit is above -inf
     first_out, last_out  the first and last key whose e exceeds thr (times sum e when whole), -1: none
     col        the head's per-key sums of e * rw[r] (divided by sum e when whole), added to (without rw: untouched)
   A row holding a NaN or +inf logit is counted in the return value, and nothing of the call may be used then: the
   caller computes such blocks with torch's ops, which give those values their meaning (probe/engine/stats.py). */
#include <math.h>
#include <stdint.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#else /* built without OpenMP's runtime (a compiler that has none, e.g. Apple's clang): one thread */
static inline int omp_get_thread_num(void) { return 0; }
#endif

/* Whether this build runs its passes on more than one thread (native_rows.threaded()). */
int attnprobe_openmp(void) {
#ifdef _OPENMP
    return 1;
#else
    return 0;
#endif
}

/* 2^y, written out so that the compiler vectorises it inline on every C library (glibc's vector exp2f, libmvec,
   exists on glibc's x86-64 builds only; elsewhere the loops called the scalar exp2f): 2^round(y) from the exponent
   bits times a degree-6 polynomial for 2^f, |f| <= 1/2 (Cephes' exp2f coefficients), within 1.7 ulp over [-126, 0]
   (torch's exp2: 1.2 ulp). 0 below -126 and for -inf: a weight under 2^-126 of its row's normaliser; clamped at 127
   above (a logit that far above the kernel's lse makes its row's sum far from 1, which the engine refuses). */
static inline float pow2(float y) {
    float c = y < -127.0f ? -127.0f : (y > 127.0f ? 127.0f : y); /* NaN stays NaN, and so does f: NaN comes out */
    float n = (c + 12582912.0f) - 12582912.0f, f = c - n; /* n = round(c): 1.5 * 2^23 drops the fraction */
    float p = 1.535336188319500e-4f;
    p = p * f + 1.339887440266574e-3f;
    p = p * f + 9.618437357674640e-3f;
    p = p * f + 5.550332471162809e-2f;
    p = p * f + 2.402264791363012e-1f;
    p = p * f + 6.931472028550421e-1f;
    int32_t bits = ((int32_t)n + 127) << 23;
    float scale;
    memcpy(&scale, &bits, sizeof scale);  /* the bits of 2^n */
    return y < -126.0f ? 0.0f : (1.0f + f * p) * scale;
}

static long row_bad(const float *restrict x, long K, float *m_out) {
    float m = -INFINITY;
    int bad = 0;
#pragma omp simd reduction(max : m) reduction(| : bad)
    for (long k = 0; k < K; k++) {
        float v = x[k];
        bad |= (v != v) | (v == INFINITY);
        m = v > m ? v : m;
    }
    *m_out = m;
    return bad;
}

/* The first key of x[0:K] holding m (0: none). 32-bit keys, twice as many a vector as 64-bit ones: K < 2^31 (the
   Python side refuses longer rows). */
static int32_t first_equal(const float *restrict x, int32_t K, float m) {
    int32_t arg = K;
#pragma omp simd reduction(min : arg)
    for (int32_t k = 0; k < K; k++) {
        int32_t c = x[k] == m ? k : K;
        arg = c < arg ? c : arg;
    }
    return arg == K ? 0 : arg;
}

static void hits(const float *restrict w, long K, float t, int64_t *first_out, int64_t *last_out) {
    long first = K, last = -1;
#pragma omp simd reduction(min : first) reduction(max : last)
    for (long k = 0; k < K; k++) {
        int hit = w[k] > t;
        long f = hit ? k : K, l = hit ? k : -1;
        first = f < first ? f : first;
        last = l > last ? l : last;
    }
    *first_out = first == K ? -1 : first;
    *last_out = last;
}

/* One row's keys (or a tile of them): e into Er, the sums added to, the keys' max returned (bad: a NaN or +inf
   logit). with_scale is a constant at each call of tile_rows below: a test of vmax inside the loop kept it from
   being vectorised (2.3x slower without an output check). */
static inline __attribute__((always_inline)) float tile_rows_(const float *restrict x, float *restrict Er, long w,
                                                              float base, const float *vmax, const int with_scale,
                                                              float *sum, float *mn, float *dot, float *sc, long *fin,
                                                              int *bad) {
    float m = -INFINITY, s = 0.0f, lo = INFINITY, d = 0.0f, scale = 0.0f;
    int32_t f = 0; /* (32 bits: twice the lanes a vector of 64) */
#pragma omp simd reduction(+ : s, d, f, scale) reduction(min : lo) reduction(max : m)
    for (long k = 0; k < w; k++) {
        float u = x[k], y = u - base, v = pow2(y);
        Er[k] = v;
        s += v;
        lo = v < lo ? v : lo;
        d += v * (y > -127.0f ? y : -127.0f); /* e = 0 below -126 (and at -inf): it adds 0 */
        f += u > -INFINITY;
        m = u > m ? u : m;
        scale += with_scale ? v * vmax[k] : 0.0f;
    }
    *sum += s;
    *mn = lo < *mn ? lo : *mn;
    *dot += d;
    *sc += scale;
    *fin += f;
    *bad |= (s != s) | (m == INFINITY); /* a NaN logit makes its e NaN, and so the sum; +inf is the max */
    return m;
}

static float tile_rows(const float *restrict x, float *restrict Er, long w, float base, const float *vmax, float *sum,
                       float *mn, float *dot, float *sc, long *fin, int *bad) {
    return vmax ? tile_rows_(x, Er, w, base, vmax, 1, sum, mn, dot, sc, fin, bad)
                : tile_rows_(x, Er, w, base, vmax, 0, sum, mn, dot, sc, fin, bad);
}

/* The rows of one head (n of them, contiguous): every row's statistics, its e * vmax (the output's scale) and its
   weights times rw[r] (divided by sum e when whole) added into col, the head's per-key sums. */
static long head_rows(const float *restrict s, float *restrict e, long n, long K, const float *restrict shift,
                      float thr, int whole, const float *restrict vmax, const float *restrict rw, float *restrict col,
                      float *restrict max_out, int64_t *restrict arg_out, float *restrict sum_out,
                      float *restrict min_out, float *restrict dot_out, float *restrict scale_out,
                      int64_t *restrict finite_out, int64_t *restrict first_out, int64_t *restrict last_out) {
    long odd = 0;
    for (long r = 0; r < n; r++) {
        const float *x = s + r * K;
        float *w = e + r * K;
        float base, m = -INFINITY, sum = 0.0f, mn = INFINITY, dot = 0.0f, sc = 0.0f;
        if (shift) {
            base = shift[r];
        } else if (row_bad(x, K, &m)) { /* the max first: e is taken less it */
            odd++;
            continue;
        } else {
            base = m == -INFINITY ? 0.0f : m;
        }
        long fin = 0;
        int bad = 0;
        m = tile_rows(x, w, K, base, vmax, &sum, &mn, &dot, &sc, &fin, &bad);
        if (bad) {
            odd++;
            continue;
        }
        max_out[r] = m;
        arg_out[r] = first_equal(x, (int32_t)K, m);
        sum_out[r] = sum;
        min_out[r] = mn;
        dot_out[r] = dot;
        scale_out[r] = sc;
        finite_out[r] = fin;
        hits(w, K, whole ? thr * sum : thr, first_out + r, last_out + r);
        if (rw) {
            float f = rw[r] * (whole ? (sum > 0.0f ? 1.0f / sum : 0.0f) : 1.0f);
#pragma omp simd
            for (long k = 0; k < K; k++) col[k] += w[k] * f;
        }
    }
    return odd;
}

/* R rows of K keys, n rows per head (R / n heads): the heads are shared out among the threads, so that each head's
   per-key sums are one thread's. vmax, col: the heads' rows of K values, vstride and cstride apart (NULL: none). */
long attnprobe_row_pass(const float *restrict s, float *restrict e, long R, long K, long n,
                        const float *restrict shift, float thr, int whole, const float *restrict vmax, long vstride,
                        const float *restrict rw, float *restrict col, long cstride, float *restrict max_out,
                        int64_t *restrict arg_out, float *restrict sum_out, float *restrict min_out,
                        float *restrict dot_out, float *restrict scale_out, int64_t *restrict finite_out,
                        int64_t *restrict first_out, int64_t *restrict last_out, int threads) {
    long odd = 0, heads = R / n;
#pragma omp parallel for schedule(static) num_threads(threads) reduction(+ : odd)
    for (long g = 0; g < heads; g++) {
        long r = g * n;
        odd += head_rows(s + r * K, e + r * K, n, K, shift ? shift + r : 0, thr, whole, vmax ? vmax + g * vstride : 0,
                         rw ? rw + r : 0, col ? col + g * cstride : 0, max_out + r, arg_out + r, sum_out + r,
                         min_out + r, dot_out + r, scale_out + r, finite_out + r, first_out + r, last_out + r);
    }
    return odd;
}

/* ------------------------------------------------------------------------------------------------------------------
   The fused pass: q @ k, the row pass and e @ v over tiles of keys that stay in the cache, for rows whose normaliser
   the model's kernel gave (the lse) and whose keys are all here, masked by an interval of keys per row and batch item
   (causal, a sliding window, packed documents) and keys no row of a batch item may attend (padding) at most. Tiles
   below every row's first key are not computed (a window's cost is the window's). No (query x key) block is written
   to memory but E, the weights of RB rows (RB x K floats), which the threshold hits and the per-key sums read once
   each row's sum is known. */
/* The products are written in vectors of one register each: VW floats (16 with AVX-512, 8 with AVX, 4 with SSE or
   NEON). A GCC vector wider than the target's registers is lowered through the stack: 64-byte vectors built for AVX2
   made the fused pass 14-24 times slower. KV vectors of keys (KV * VW = CW keys) and RB rows of products fill a
   tile's accumulators: 4 with 32 registers (AVX-512, AArch64), 2 with 16, so that RB x KV sums, the KV loaded
   vectors and one broadcast stay in registers. */
#if defined(__AVX512F__)
#define VW 16
#elif defined(__AVX__)
#define VW 8
#else
#define VW 4
#endif
#if defined(__AVX512F__) || defined(__aarch64__)
#define KV 4
#else
#define KV 2
#endif
#define CW (KV * VW)
typedef float vf __attribute__((vector_size(VW * 4), aligned(4))); /* VW floats, any alignment */

#define RB 4
#define TK 512    /* keys per tile: a multiple of PANEL */
#define PANEL 64  /* keys per panel (native_rows.py's _PANEL) */
#define ROWS_SUMMED 64 /* rows whose per-key sums are added up apart (a multiple of RB) */

struct fused_args {
    const float *q;           /* the rows' q: row i of head g at g / h * q_sb + g % h * q_sh + i * q_st, d contiguous */
    const float *k;           /* the keys, the same way (Tk of them a head; heads of k: see kv_group) */
    const float *v;           /* the values, the same way, or NULL (no output check; else each key's largest |v|, the
                                 output's scale, is taken per head in the work space) */
    long q_sb, q_sh, q_st, k_sb, k_sh, k_st, v_sb, v_sh, v_st, h; /* strides; heads per batch item */
    long kv_group;            /* heads of q that read each head of k and v: head g % h reads g % h / kv_group */
    float q_scale;            /* q times it: the scaling and log2(e) */
    const float *shift;       /* G x n: the kernel's lse, base 2 */
    const int64_t *start;     /* (G / H) x n: the first key each row may attend, or NULL: key 0 */
    const int64_t *limit;     /* (G / H) x n: the first key past those each row may attend, or NULL: K */
    const uint8_t *keep;      /* (G / H) x K, 0 where no row of the head's batch item may attend the key, or NULL */
    long H, keep_stride;      /* heads per item of the mask; keep's stride between items (0: one row for every item) */
    long row_stride;          /* start's and limit's stride between items (0: one set of rows for every item) */
    const int64_t *diag;      /* n: each row's own key, or NULL */
    const int64_t *firstkey;  /* G: the first key any row may attend */
    const float *rw;          /* G x n: what each row's weights count for in the per-key sums */
    long G, n, D, Dv, Tk, K;  /* heads, rows per head, head sizes, keys of k, keys of this block (0..K) */
    float thr;                /* a key is a hit where e > thr * sum e */
    float *max, *sum, *min, *dot, *scale; /* G x n */
    int64_t *arg, *finite, *first, *last;                               /* G x n */
    const float *o;           /* the output the call returned (with v): row i of head g as q's, o_* its strides */
    long o_sb, o_sh, o_st;
    float *err;               /* G x n: the output check, max over the columns of |sum e * v / sum e - o| (with v) */
    float *col;               /* G x K: the per-key sums, added to */
    float *work;              /* threads x work_floats (even): the per-key sums in double (K), E (RB x K), the per-key
                                 sums of a few rows (K), q (RB x D), the rows' sum e * v (RB x Dv), the head's panels
                                 (P x D x 64), each key's largest |v| (K, with v) and, where v's rows are not Dv
                                 apart, its values (K x Dv) */
    long work_floats;
    int threads;
    /* The rows' statistics as the engine gives them (stats.py's ROW_STATS; NULL: the sums above alone), each
       FINAL_* x G x n in the order of the enums below: the sums divided by sum e, the max in natural units, the keys
       each row may attend counted from its interval (and keep), finite. A row whose sum e is off 1 by more than fit
       (the lse is not these logits') makes the call return a negative count. */
    float *final_f;
    int64_t *final_i;
    uint8_t *final_b;
    const int64_t *count; /* as start: the keys each row may attend (keep's keys in its interval), or NULL: limit -
                             start */
    float fit;
};

enum { F_ENTROPY, F_MAX_WEIGHT, F_MIN_WEIGHT, F_FIRST_KEY_MASS, F_DIAGONAL_MASS, F_PREVIOUS_MASS, F_MASKED_MASS,
       F_MASKED_MAX, F_ROW_SUM_ERROR, F_MAX_SCORE, F_OUTPUT_ERROR, F_OUTPUT_SCALE, FINAL_F };
enum { I_ARGMAX_KEY, I_FIRST_KEY, I_LAST_KEY, I_ALLOWED_KEYS, I_FIRST_ALLOWED, I_LAST_ALLOWED, FINAL_I };
enum { B_FINITE, B_DIAGONAL_ALLOWED, FINAL_B };

#define HEAD(a, t, g) ((a)->t + (g) / (a)->h * (a)->t##_sb + (g) % (a)->h * (a)->t##_sh)
/* k's or v's head that head g of q reads */
#define KV_HEAD(a, t, g) ((a)->t + (g) / (a)->h * (a)->t##_sb + (g) % (a)->h / (a)->kv_group * (a)->t##_sh)

/* The row of D floats at x into the cache, ahead of its use: rows a projection's stride apart (a page or more) are
   not fetched by the hardware's prefetchers, and each one's first load waited on memory. */
static inline void prefetch_row(const float *x, long D) {
    for (long dd = 0; dd < D; dd += 16) __builtin_prefetch(x + dd);
}

#define AHEAD 16 /* rows fetched ahead */

/* The head's keys from..K in panels of 64 (P x D x 64), each transposed: panel p holds keys 64p..64p+63 as D rows of
   64 (zeros past K), so that q @ k reads each panel in order. Made by each thread for the head it takes (the key
   tensor is read through its strides: no copy of the call's keys). */
static void make_panels(const float *k, long st, long D, long from, long K, float *panels) {
    for (long j = from - from % PANEL; j < K && j < from - from % PANEL + AHEAD; j++) prefetch_row(k + j * st, D);
    for (long p = from / PANEL; p * PANEL < K; p++) {
        float *panel = panels + p * D * PANEL;
        const float *kp = k + p * PANEL * st;
        long here = K - p * PANEL < PANEL ? K - p * PANEL : PANEL; /* the panel's keys below K */
        for (long j = 0; j < here && p * PANEL + j + AHEAD < K; j++) prefetch_row(kp + (j + AHEAD) * st, D);
        if (here == PANEL) {
            for (long dd = 0; dd < D; dd++) { /* a column of k at a time: the stores are contiguous */
#pragma omp simd
                for (int32_t j = 0; j < PANEL; j++) panel[dd * PANEL + j] = kp[j * st + dd];
            }
        } else {
            for (long dd = 0; dd < D; dd++)
                for (long j = 0; j < PANEL; j++) panel[dd * PANEL + j] = j < here ? kp[j * st + dd] : 0.0f;
        }
    }
}

/* The head's values from key `from` on: each key's largest |v| into vmax (the output's scale) and, with V, the values
   in a block of their own (rows a projection's stride apart, a multiple of 512 bytes say, fall into a few of L1's
   sets, and every group of rows reads them again). Keys below `from` are never read (E is 0 there, and 0 times an
   unwritten value may be NaN: the tiles start at `from`). */
static void head_values(const float *v, long st, long Dv, long from, long K, float *V, float *vmax) {
    for (long j = from; j < K; j++) {
        if (j + AHEAD < K) prefetch_row(v + (j + AHEAD) * st, Dv);
        const float *vr = v + j * st;
        if (V) vr = memcpy(V + j * Dv, vr, Dv * sizeof *vr);
        float m = 0.0f;
        int32_t nan = 0;
#pragma omp simd reduction(max : m) reduction(| : nan)
        for (long c = 0; c < Dv; c++) {
            float x = vr[c] < 0.0f ? -vr[c] : vr[c];
            m = x > m ? x : m;
            nan |= x != x;
        }
        vmax[j] = nan ? NAN : m; /* as torch's max: a NaN value makes the key's scale NaN */
    }
}

/* Loaded vectors kept in registers: the compiler folded each load into every product that reads it (a memory
   operand each), which made the products wait on the loads (one 64-byte load a cycle against one product). */
#if defined(__GNUC__) && defined(__x86_64__) && defined(__AVX512F__) /* measured there (AVX2: no difference) */
#define IN_REGISTERS2(a, b) __asm__("" : "+v"(a), "+v"(b))
#else
#define IN_REGISTERS2(a, b)
#endif

/* S[r][0:w] = q[r] . k[0:w] for RB rows (rows past rb repeat the last: they are computed, never read), from the
   panels of 64 keys that start the tile, CW keys at a time: each panel's D x 64 floats are read in order, so that the
   loads stream (a (D x Tk) layout read 64 keys from D rows Tk floats apart: a third slower at 32k keys). A chunk's
   keys past w are computed too (zeros, or the next tile's keys) and never read. */
static void qk_tile(const float *q, long D, const float *kP, long w, float S[RB][TK]) {
    const float *qr[RB];
    for (int r = 0; r < RB; r++) qr[r] = q + r * D;
    for (long j = 0; j < w; j += CW) {
        const float *chunk = kP + (j / PANEL) * D * PANEL + j % PANEL;
        vf acc[RB][KV];
        for (int r = 0; r < RB; r++)
            for (int t = 0; t < KV; t++) acc[r][t] = (vf){0};
        for (long dd = 0; dd < D; dd++) {
            const float *kr = chunk + dd * PANEL;
            vf k0 = *(const vf *)kr, k1 = *(const vf *)(kr + VW);
            IN_REGISTERS2(k0, k1);
#if KV == 4
            vf k2 = *(const vf *)(kr + 2 * VW), k3 = *(const vf *)(kr + 3 * VW);
            IN_REGISTERS2(k2, k3);
#endif
            for (int r = 0; r < RB; r++) {
                float x = qr[r][dd];
                acc[r][0] += x * k0;
                acc[r][1] += x * k1;
#if KV == 4
                acc[r][2] += x * k2;
                acc[r][3] += x * k3;
#endif
            }
        }
        for (int r = 0; r < RB; r++)
            for (int t = 0; t < KV; t++) *(vf *)(S[r] + j + VW * t) = acc[r][t];
    }
}

/* out[r] += E[r][0:w] @ v[0:w] for rb rows (v's keys vs apart), 2 VW of v's columns at a time, then VW, then one
   by one. All RB rows of E are read (those past rb hold an earlier group's weights, or anything: their sums are never
   stored), so that the inner loop has no test. */
static void ev_tile(const float *E, long K, long rb, const float *v, long vs, long Dv, long w, float *out) {
    long c = 0;
    for (; c + 2 * VW <= Dv; c += 2 * VW) {
        vf acc[RB][2];
        for (int r = 0; r < RB; r++) acc[r][0] = acc[r][1] = (vf){0};
        for (long j = 0; j < w; j++) {
            const float *vr = v + j * vs + c;
            vf v0 = *(const vf *)vr, v1 = *(const vf *)(vr + VW);
            IN_REGISTERS2(v0, v1);
            for (int r = 0; r < RB; r++) {
                float x = E[r * K + j];
                acc[r][0] += x * v0;
                acc[r][1] += x * v1;
            }
        }
        for (long r = 0; r < rb; r++) {
            *(vf *)(out + r * Dv + c) += acc[r][0];
            *(vf *)(out + r * Dv + c + VW) += acc[r][1];
        }
    }
    for (; c + VW <= Dv; c += VW) { /* with AVX-512, head sizes 16, 48, 80, 112: their last 16 columns */
        vf acc[RB];
        for (int r = 0; r < RB; r++) acc[r] = (vf){0};
        for (long j = 0; j < w; j++) {
            vf v0 = *(const vf *)(v + j * vs + c);
            for (int r = 0; r < RB; r++) acc[r] += E[r * K + j] * v0;
        }
        for (long r = 0; r < rb; r++) *(vf *)(out + r * Dv + c) += acc[r];
    }
    for (long r = 0; r < rb; r++)
        for (long cc = c; cc < Dv; cc++) {
            float x = 0.0f;
            for (long j = 0; j < w; j++) x += E[r * K + j] * v[j * vs + cc];
            out[r * Dv + cc] += x;
        }
}

/* The keys [lo[r], lim[r]) each of the rb rows may attend (an empty row: lo = lim), and the first tile's key: the
   first key of some row, down to a panel's start. */
static long row_keys(const struct fused_args *a, long g, long i0, long rb, long lo[RB], long lim[RB], long *kmax) {
    long K = a->K, item = (g / a->H) * a->row_stride, kmin = K;
    *kmax = 0;
    for (long r = 0; r < rb; r++) {
        long s = a->start ? a->start[item + i0 + r] : 0, l = a->limit ? a->limit[item + i0 + r] : K;
        lo[r] = s < 0 ? 0 : (s > K ? K : s);
        lim[r] = l < lo[r] ? lo[r] : (l > K ? K : l);
        if (lim[r] > lo[r]) {
            kmin = lo[r] < kmin ? lo[r] : kmin;
            *kmax = lim[r] > *kmax ? lim[r] : *kmax;
        }
    }
    return kmin >= *kmax ? *kmax : kmin - kmin % PANEL;
}

/* The output check of row i0 + r of head g: the largest difference between its sum e * v over sum e (out, Dv
   floats) and the output the call returned, as torch's ops take it (1 / sum, 0 for an empty row; NaN comes out). */
static float output_error(const struct fused_args *a, long g, long i0, long r, const float *out, float sum) {
    const float *o = HEAD(a, o, g) + (i0 + r) * a->o_st;
    float inv = sum > 0.0f ? 1.0f / sum : 0.0f, e = 0.0f;
    int32_t nan = 0;
#pragma omp simd reduction(max : e) reduction(| : nan)
    for (long c = 0; c < a->Dv; c++) {
        float d = out[c] * inv - o[c];
        d = d < 0.0f ? -d : d;
        e = d > e ? d : e;
        nan |= d != d;
    }
    return nan ? NAN : e;
}

/* What one row of the fused pass summed (base 2: the max, and the entropy's sum, of the logits less the kernel's lse). */
struct row_sums {
    float m, sum, min, dot, scale, err; /* err: the output check (NaN without v) */
    long arg, fin;
};

#define LN2F 0.6931471805599453f

/* The row's statistics as stats.py's _Engine._finish gives them for rows whose normaliser is the kernel's lse (one
   block of every key they reach, a boolean mask or none): into final_*, at row i of G x n. Returns 1 where the row's
   sum e is off 1 by more than fit (the lse is not these logits'). de, pe, fe: e at the row's own key, the one before
   it and the first key (NaN, NaN, 0 where the key does not exist). */
static long final_row(const struct fused_args *a, long i, long item, long lo, long L, const uint8_t *keep, long dg,
                      const struct row_sums *x, long first, long last, float de, float pe, float fe) {
    long GN = a->G * a->n, count = a->count ? a->count[item] : L - lo;
    float sum = x->sum, inv = sum > 0.0f ? 1.0f / sum : 0.0f, ms = x->m * LN2F, lse = a->shift[i] * LN2F;
    float dot = count != x->fin ? NAN : x->dot * LN2F; /* an allowed key at -inf: not finite (torch's -inf * 0) */
    int empty = ms == -INFINITY, has_v = a->v != 0;
    float *f = a->final_f + i;
    f[F_ENTROPY * GN] = sum > 0.0f ? logf(sum) * (sum * inv) - dot * inv : 0.0f;
    f[F_MAX_WEIGHT * GN] = empty ? 0.0f : expf(ms - lse) * inv;
    f[F_MIN_WEIGHT * GN] = (L < a->K || lo > 0 || a->K < a->Tk ? 0.0f : x->min) * inv; /* keys out of reach weigh 0 */
    f[F_FIRST_KEY_MASS * GN] = fe * inv;
    f[F_DIAGONAL_MASS * GN] = de * inv;
    f[F_PREVIOUS_MASS * GN] = pe * inv;
    f[F_MASKED_MASS * GN] = f[F_MASKED_MAX * GN] = 0.0f;
    f[F_ROW_SUM_ERROR * GN] = fabsf(sum * inv - 1.0f);
    f[F_MAX_SCORE * GN] = ms;
    f[F_OUTPUT_ERROR * GN] = has_v ? x->err : NAN;
    f[F_OUTPUT_SCALE * GN] = has_v ? x->scale * inv : NAN;
    int64_t *n = a->final_i + i;
    n[I_ARGMAX_KEY * GN] = empty ? 0 : x->arg;
    n[I_FIRST_KEY * GN] = first, n[I_LAST_KEY * GN] = last;
    n[I_ALLOWED_KEYS * GN] = count;
    n[I_FIRST_ALLOWED * GN] = count > 0 ? lo : -1, n[I_LAST_ALLOWED * GN] = count > 0 ? L - 1 : -1;
    int finite = (isfinite(dot) && isfinite(sum) && !isnan(ms)) || (empty && dot == 0.0f);
    a->final_b[B_FINITE * GN + i] = finite && (!has_v || isfinite(x->err));
    a->final_b[B_DIAGONAL_ALLOWED * GN + i] = dg >= lo && dg < L && (!keep || keep[dg]);
    return count > 0 && isfinite(sum) && fabsf(sum - 1.0f) > a->fit;
}

/* One row's results, its hits and per-key sums once its sum is known: from E's keys lo..L of the row (its final
   statistics too, with final_f: final_row's return). */
static long finish_row(const struct fused_args *a, long g, long i0, long r, const float *Er, long lo, long L,
                       const uint8_t *keep, const struct row_sums *x, float *restrict col) {
    long i = g * a->n + i0 + r, K = a->K;
    float sum = x->sum, f = a->rw[i] * (sum > 0.0f ? 1.0f / sum : 0.0f), t = a->thr * sum;
    int32_t first = (int32_t)K, last = -1; /* 32-bit keys, VW a vector (K < 2^31: _run_fused refuses more) */
#pragma omp simd reduction(min : first) reduction(max : last)
    for (int32_t k = (int32_t)lo; k < (int32_t)L; k++) { /* the hits and the per-key sums in one read of the row */
        float e = Er[k];
        col[k] += e * f;
        int32_t h = e > t ? k : (int32_t)K, l = e > t ? k : -1;
        first = h < first ? h : first;
        last = l > last ? l : last;
    }
    first = first == K ? -1 : first;
    long dg = a->diag ? a->diag[i0 + r] : -1, fk = a->firstkey[g];
    float de = dg >= 0 && dg < K ? (dg >= lo && dg < L ? Er[dg] : 0.0f) : NAN;
    float pe = dg >= 1 && dg - 1 < K ? (dg - 1 >= lo && dg - 1 < L ? Er[dg - 1] : 0.0f) : NAN;
    float fe = fk >= 0 && fk < K ? (fk >= lo && fk < L ? Er[fk] : 0.0f) : 0.0f;
    a->max[i] = x->m, a->arg[i] = x->arg, a->sum[i] = sum, a->dot[i] = x->dot, a->scale[i] = x->scale;
    a->min[i] = L < K || lo > 0 ? 0.0f : x->min; /* keys out of the row's reach weigh 0 */
    a->finite[i] = x->fin;
    a->first[i] = first, a->last[i] = last;
    if (a->err) a->err[i] = x->err;
    if (!a->final_f) return 0;
    long item = (g / a->H) * a->row_stride + i0 + r;
    return final_row(a, i, item, lo, L, keep, dg, x, first, last, de, pe, fe);
}

static long fused_group(const struct fused_args *a, long g, long i0, long rb, float *E, float *q, float *out,
                        const float *kP, const float *v, const float *vmax, float *col, long *hi) {
    for (long r = 0; r < RB; r++) { /* the rows times q_scale; those past rb repeat the last (computed, never read) */
        const float *qr = HEAD(a, q, g) + (i0 + (r < rb ? r : rb - 1)) * a->q_st;
        for (long dd = 0; dd < a->D; dd++) q[r * a->D + dd] = qr[dd] * a->q_scale;
        if (i0 + RB + r < a->n) prefetch_row(qr + RB * a->q_st, a->D); /* the next group's rows */
    }
    const uint8_t *keep = a->keep ? a->keep + (g / a->H) * a->keep_stride : 0;
    long K = a->K, lo[RB], lim[RB], kmax, arg[RB], fin[RB], row0 = g * a->n + i0;
    long kmin = row_keys(a, g, i0, rb, lo, lim, &kmax);
    float m[RB], sum[RB], mn[RB], dot[RB], sc[RB];
    int bad = 0;
    for (long r = 0; r < rb; r++) {
        m[r] = -INFINITY, sum[r] = 0.0f, mn[r] = INFINITY, dot[r] = 0.0f, sc[r] = 0.0f, arg[r] = 0, fin[r] = 0;
        for (long c = 0; v && c < a->Dv; c++) out[r * a->Dv + c] = 0.0f;
        if (v) prefetch_row(HEAD(a, o, g) + (i0 + r) * a->o_st, a->Dv); /* read once the row's sum is known */
    }
    float S[RB][TK];
    *hi = kmax > *hi ? kmax : *hi;
    for (long j0 = kmin; j0 < kmax; j0 += TK) {
        long w = kmax - j0 < TK ? kmax - j0 : TK;
        qk_tile(q, a->D, kP + (j0 / PANEL) * a->D * PANEL, w, S);
        for (long r = 0; r < rb; r++) {
            for (long j = 0; j < w && j0 + j < lo[r]; j++) S[r][j] = -INFINITY;
            for (long j = lim[r] - j0 < 0 ? 0 : lim[r] - j0; j < w; j++) S[r][j] = -INFINITY;
            if (keep)
                for (long j = 0; j < w; j++) S[r][j] = keep[j0 + j] ? S[r][j] : -INFINITY;
            float tm = tile_rows(S[r], E + r * K + j0, w, a->shift[row0 + r], vmax ? vmax + j0 : 0, sum + r, mn + r,
                                 dot + r, sc + r, fin + r, &bad);
            if (tm > m[r]) {
                m[r] = tm;
                arg[r] = j0 + first_equal(S[r], (int32_t)w, tm);
            }
        }
        if (bad) return 1;
        if (v) ev_tile(E + j0, K, rb, v + j0 * a->Dv, a->Dv, a->Dv, w, out);
    }
    long misfit = 0;
    for (long r = 0; r < rb; r++) {
        struct row_sums x = {m[r], sum[r], mn[r], dot[r], sc[r], v ? output_error(a, g, i0, r, out + r * a->Dv, sum[r])
                                                                      : NAN, arg[r], fin[r]};
        misfit += finish_row(a, g, i0, r, E + r * K, lo[r], lim[r], keep, &x, col);
    }
    return -misfit;
}

/* One head's rows over keys laid out from base on (kP, vh, vmax): the rows RB at a time, the per-key sums of
   ROWS_SUMMED rows at a time in part, then added up in double (one by one, the float sums of thousands of rows lost
   digits: 1e-5 of a key's weight of 7.6 at 1,024 rows), then into the head's col. */
static long head_rows_fused(const struct fused_args *a, long g, int later, long base, float *E, float *q, float *out,
                            const float *kP, const float *vh, const float *vmax, float *part, double *acc,
                            long *misfit) {
    long odd = 0, hi = base;
    memset(part + base, 0, (a->K - base) * sizeof *part);
    memset(acc + base, 0, (a->K - base) * sizeof *acc);
    if (later) /* a later head of a shared layout: its first rows (the first head's were fetched before the layout) */
        for (long i = 0; i < RB && i < a->n; i++) prefetch_row(HEAD(a, q, g) + i * a->q_st, a->D);
    for (long i0 = 0; i0 < a->n; i0 += RB) {
        long got = fused_group(a, g, i0, a->n - i0 < RB ? a->n - i0 : RB, E, q, out, kP, vh, vmax, part, &hi);
        odd += got > 0 ? got : 0, *misfit -= got < 0 ? got : 0;
        if ((i0 + RB) % ROWS_SUMMED == 0 || i0 + RB >= a->n) {
#pragma omp simd
            for (long k = base; k < hi; k++) acc[k] += part[k], part[k] = 0.0f;
            hi = base;
        }
    }
    float *col = a->col + g * a->K; /* the head's per-key sums: added to */
#pragma omp simd
    for (long k = base; k < a->K; k++) col[k] += (float)acc[k];
    return odd;
}

/* Every head's rows, RB at a time; the heads are shared out among the threads (each head's per-key sums are one
   thread's), the heads that read one kv head (kv_group) together where there are as many such groups as threads:
   their kv head's keys are laid out once. Returns the rows' groups that held a NaN or +inf logit (nothing may be used
   then), else minus the rows whose sum e is off 1 by more than fit (with final_f; nothing may be used then either),
   else 0. */
long attnprobe_fused(const struct fused_args *a) {
    long odd = 0, misfit = 0, panels = (a->K + PANEL - 1) / PANEL * PANEL * a->D;
    long per = a->kv_group > 1 && a->G / a->kv_group >= a->threads ? a->kv_group : 1; /* heads sharing a layout */
#pragma omp parallel for schedule(static) num_threads(a->threads) reduction(+ : odd, misfit)
    for (long g0 = 0; g0 < a->G; g0 += per) {
        double *acc = (double *)(a->work + (long)omp_get_thread_num() * a->work_floats); /* work_floats is even */
        float *E = (float *)(acc + a->K), *part = E + RB * a->K, *q = part + a->K, *out = q + RB * a->D;
        float *kP = out + (a->v ? RB * a->Dv : 0);
        float *vmax = a->v ? kP + panels : 0, *V = a->v && a->v_st != a->Dv ? vmax + a->K : 0;
        long from = a->K;
        for (long g = g0; g < g0 + per; g++) { /* the first key any row of the heads may attend */
            long item = (g / a->H) * a->row_stride;
            for (long i = 0; i < a->n; i++) {
                long s = a->start ? a->start[item + i] : 0;
                from = s < from ? (s < 0 ? 0 : s) : from;
            }
        }
        for (long i = 0; i < RB && i < a->n; i++) /* the first group's rows */
            prefetch_row(HEAD(a, q, g0) + i * a->q_st, a->D);
        make_panels(KV_HEAD(a, k, g0), a->k_st, a->D, from, a->K, kP);
        if (a->v) head_values(KV_HEAD(a, v, g0), a->v_st, a->Dv, from - from % PANEL, a->K, V, vmax);
        const float *vh = V ? V : a->v ? KV_HEAD(a, v, g0) : 0; /* values with rows Dv apart: read where they are */
        long base = from - from % PANEL;
        for (long g = g0; g < g0 + per; g++)
            odd += head_rows_fused(a, g, g != g0, base, E, q, out, kP, vh, vmax, part, acc, &misfit);
    }
    return odd ? odd : -misfit;
}

/* ------------------------------------------------------------------------------------------------------------------
   A boolean mask's form, for the fused pass: rows of d bools (0/1 bytes; row r of item b at mask + b * s_item +
   r * s_row, the keys contiguous; a stride of 0 repeats one row or item). Writes each row's first allowed key
   (start), the key past its last (limit; d and d for a row that allows none), how many it allows (count), and keep,
   the keys some row of the item allows. Returns 1 where every row allows exactly the keys of keep in [start, limit),
   else 0 (start, limit, count and keep are written either way). */
static void one_row(const uint8_t *restrict x, long d, int64_t *start, int64_t *limit, int64_t *count) {
    long first = d, last = -1;
    int32_t c = 0;
#pragma omp simd reduction(min : first) reduction(max : last) reduction(+ : c)
    for (long k = 0; k < d; k++) {
        int on = x[k] != 0;
        long f = on ? k : d, l = on ? k : -1;
        first = f < first ? f : first;
        last = l > last ? l : last;
        c += on;
    }
    *start = last < 0 ? d : first;
    *limit = last < 0 ? d : last + 1;
    *count = c;
}

static int row_fits(const uint8_t *restrict x, const uint8_t *restrict keep, long d, long s, long l) {
    int ok = 1;
#pragma omp simd reduction(& : ok)
    for (long k = 0; k < d; k++) ok &= (x[k] != 0) == ((keep[k] != 0) & (k >= s) & (k < l));
    return ok;
}

long attnprobe_intervals(const uint8_t *mask, long items, long n, long d, long s_item, long s_row, int64_t *start,
                         int64_t *limit, int64_t *count, uint8_t *keep, int threads) {
    long fits = 1;
#pragma omp parallel num_threads(threads)
    {
#pragma omp for schedule(static)
        for (long i = 0; i < items * n; i++)
            one_row(mask + (i / n) * s_item + (i % n) * s_row, d, start + i, limit + i, count + i);
        long chunks = (d + 4095) / 4096;
#pragma omp for schedule(static)
        for (long t = 0; t < items * chunks; t++) { /* keep: the rows OR'ed (one row, where they all are one) */
            long b = t / chunks, k0 = (t % chunks) * 4096, k1 = k0 + 4096 < d ? k0 + 4096 : d;
            uint8_t *kb = keep + b * d;
            memset(kb + k0, 0, k1 - k0);
            for (long r = 0; r < (s_row ? n : 1); r++) {
                const uint8_t *x = mask + b * s_item + r * s_row;
#pragma omp simd
                for (long k = k0; k < k1; k++) kb[k] |= x[k] != 0;
            }
        }
#pragma omp for schedule(static) reduction(& : fits)
        for (long i = 0; i < items * n; i++)
            fits &= row_fits(mask + (i / n) * s_item + (i % n) * s_row, keep + (i / n) * d, d, start[i], limit[i]);
    }
    return fits;
}
