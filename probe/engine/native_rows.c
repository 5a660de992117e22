/* attnprobe's native row pass (probe/engine/native_rows.py builds and loads it; probe/engine/stats.py calls it).

   For each of R rows of K base-2 logits s (-inf where the row may not attend), in one call:
     max_out    the row's largest logit                      arg_out    the first key holding it
     e          exp2(s - shift) written out, shift = the given per-row shift (the kernel's lse), or the row's max
                (0 when the max is -inf)
     sum_out    sum e                                        min_out    min e
     dot_out    sum e * (s - shift) over the keys where e > 0 (forbidden keys and underflow count 0)
     finite_out the keys whose logit is above -inf
     first_out, last_out  the first and last key whose e exceeds thr (times sum e when relative), -1: none
   A row holding a NaN or +inf logit is left unwritten and counted in the return value: the caller computes such
   blocks with torch's ops, which give those values their meaning (probe/engine/stats.py). */
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

long attnprobe_row_pass(const float *restrict s, float *restrict e, long R, long K, const float *restrict shift,
                        float thr, int relative, float *restrict max_out, int64_t *restrict arg_out,
                        float *restrict sum_out, float *restrict min_out, float *restrict dot_out,
                        int64_t *restrict finite_out, int64_t *restrict first_out, int64_t *restrict last_out,
                        int threads) {
    long odd = 0;
#pragma omp parallel for schedule(static) num_threads(threads) reduction(+ : odd)
    for (long r = 0; r < R; r++) {
        const float *x = s + r * K;
        float *w = e + r * K;
        float base, m = -INFINITY, sum = 0.0f, mn = INFINITY, dot = 0.0f;
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
#pragma omp simd reduction(+ : sum, dot, fin) reduction(min : mn) reduction(max : m) reduction(| : bad)
        for (long k = 0; k < K; k++) {
            float u = x[k], y = u - base, v = exp2f(y);
            w[k] = v;
            sum += v;
            mn = v < mn ? v : mn;
            dot += v > 0.0f ? v * y : 0.0f;
            fin += u > -INFINITY;
            bad |= (u != u) | (u == INFINITY);
            m = u > m ? u : m;
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
        finite_out[r] = fin;
        hits(w, K, relative ? thr * sum : thr, first_out + r, last_out + r);
    }
    return odd;
}
