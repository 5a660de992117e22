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

#ifdef ATTNPROBE_MVEC
/* glibc's vectorised exp2f (libmvec), declared as glibc's math-vector.h declares it under -ffast-math: the loops
   below keep IEEE semantics for -inf (exp2(-inf) = 0) and NaN, which -ffast-math would give up */
#pragma omp declare simd notinbranch
float exp2f(float);
#endif

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

static long first_equal(const float *restrict x, long K, float m) {
    long arg = K;
#pragma omp simd reduction(min : arg)
    for (long k = 0; k < K; k++) {
        long c = x[k] == m ? k : K;
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
#pragma omp simd reduction(+ : sum, dot, fin, sc) reduction(min : mn) reduction(max : m) reduction(| : bad)
        for (long k = 0; k < K; k++) {
            float u = x[k], y = u - base, v = exp2f(y);
            w[k] = v;
            sum += v;
            mn = v < mn ? v : mn;
            dot += v > 0.0f ? v * y : 0.0f;
            fin += u > -INFINITY;
            bad |= (u != u) | (u == INFINITY);
            m = u > m ? u : m;
            sc += vmax ? v * vmax[k] : 0.0f;
        }
        if (bad) {
            odd++;
            continue;
        }
        max_out[r] = m;
        arg_out[r] = first_equal(x, K, m);
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
