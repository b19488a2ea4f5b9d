/* Memory-bound CPU kernels for steps of a few rows (a decode step), built on the host by engine/cpu_kernels.py.

   A decode step multiplies one or a few rows by every weight of the model once: its time is the time to read the
   weights from memory. Library GEMM kernels reach a fraction of the core's read bandwidth at one row (measured
   7-10 GB/s against 24 GB/s for a plain sum over the same bytes, AMD EPYC, float32), since they are built for reuse
   the single row does not have. These kernels read each weight row once, four rows at a time (four streams), with
   the next block of rows prefetched while the current one is summed, and keep up to four input rows' partial sums
   in registers, so that each weight line is read once for all of them.
   Float32 only; results equal a GEMM's to float rounding (the same products summed in another order). */
#include <stdint.h>
#include <string.h>
#include <math.h>

#define VW 16 /* floats per vector: 64 bytes, one cache line */
#define NB 4  /* weight rows per block (BLOCK names four) */
typedef float vec __attribute__((vector_size(VW * sizeof(float))));

static inline vec load(const float *p) { vec v; memcpy(&v, p, sizeof v); return v; }

typedef int ivec __attribute__((vector_size(VW * sizeof(int))));

/* The sum of a vector's lanes as a tree of four shuffle-adds (a chain of 16 scalar adds would cost more than the
   block's loads at few rows). */
static inline float hsum(vec v) {
    v += __builtin_shuffle(v, (ivec){8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7});
    v += __builtin_shuffle(v, (ivec){4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11});
    v += __builtin_shuffle(v, (ivec){2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13});
    v += __builtin_shuffle(v, (ivec){1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14});
    return v[0];
}

static inline void prefetch(const float *p, int64_t n) {
    for (int64_t i = 0; i < n; i += VW) __builtin_prefetch(p + i, 0, 3);
}

/* Holds values in vector registers: without it the compiler reloads each weight vector from memory for every row
   (a memory operand per multiply), and at four rows the loads, not memory, set the pace. */
#if defined(__GNUC__) && (defined(__x86_64__) || defined(__i386__))
#define KEEP(a, b, c, d) __asm__("" : "+v"(a), "+v"(b), "+v"(c), "+v"(d))
#else
#define KEEP(a, b, c, d) ((void)0)
#endif

/* One block: rows r < RB of y for the NB weight rows at wn. Each weight vector is loaded once and multiplied into
   all RB rows' sums; the RB * NB sums and the RB input vectors are named locals, so they stay in registers. */
#define BLOCK(RB)                                                                                                   \
    static void block##RB(const float *x, int64_t K, const float *wn, const float *bias, float *y, int64_t ldy) {   \
        const int64_t kv = K & ~(int64_t)(VW - 1);                                                                  \
        vec acc[RB][NB];                                                                                            \
        _Pragma("GCC unroll 4") for (int r = 0; r < RB; r++)                                                        \
            _Pragma("GCC unroll 4") for (int i = 0; i < NB; i++) acc[r][i] = (vec){0};                              \
        for (int64_t k = 0; k < kv; k += VW) {                                                                      \
            vec w0 = load(wn + k), w1 = load(wn + K + k), w2 = load(wn + 2 * K + k), w3 = load(wn + 3 * K + k);       \
            KEEP(w0, w1, w2, w3);                                                                                   \
            _Pragma("GCC unroll 4") for (int r = 0; r < RB; r++) {                                                  \
                const vec xr = load(x + r * K + k);                                                                 \
                acc[r][0] += w0 * xr; acc[r][1] += w1 * xr; acc[r][2] += w2 * xr; acc[r][3] += w3 * xr;             \
            }                                                                                                       \
        }                                                                                                           \
        for (int r = 0; r < RB; r++)                                                                                \
            for (int i = 0; i < NB; i++) {                                                                          \
                float s = hsum(acc[r][i]);                                                                          \
                for (int64_t k = kv; k < K; k++) s += wn[i * K + k] * x[r * K + k];                                 \
                y[r * ldy + i] = s + (bias ? bias[i] : 0.f);                                                        \
            }                                                                                                       \
    }
BLOCK(1)
BLOCK(2)
BLOCK(4)

/* y[r, n] = sum_k x[r, k] w[n, k] (+ bias[n]) for r < rows, n < N; w row-major [N, K]. ``after``: memory read next
   (the caller's next weight), whose first block is prefetched while the last block of w is summed; may be NULL. */
static void gemv(const float *x, int64_t rows, int64_t K, const float *w, int64_t N, const float *bias, float *y,
                 int64_t ldy, const float *after) {
    const int64_t blk = NB * K;
    int64_t n = 0;
    prefetch(w, blk < N * K ? blk : N * K);
    for (; n + NB <= N; n += NB) {
        const float *wn = w + n * K;
        const float *b = bias ? bias + n : NULL;
        if (n + 2 * NB <= N) prefetch(wn + blk, blk);
        else if (after) prefetch(after, blk);
        int64_t r = 0;
        for (; r + 4 <= rows; r += 4) block4(x + r * K, K, wn, b, y + r * ldy + n, ldy);
        if (r + 2 <= rows) { block2(x + r * K, K, wn, b, y + r * ldy + n, ldy); r += 2; }
        if (r < rows) block1(x + r * K, K, wn, b, y + r * ldy + n, ldy);
    }
    for (; n < N; n++)
        for (int64_t r = 0; r < rows; r++) {
            float s = 0.f;
            for (int64_t k = 0; k < K; k++) s += w[n * K + k] * x[r * K + k];
            y[r * ldy + n] = s + (bias ? bias[n] : 0.f);
        }
}

/* y [rows, N] = x [rows, K] @ w[N, K]^T (+ bias [N]); every array contiguous float32. */
void duet_linear_f32(const float *x, int64_t rows, int64_t K, const float *w, int64_t N, const float *bias,
                     float *y) {
    gemv(x, rows, K, w, N, bias, y, N, NULL);
}

/* A SwiGLU MoE layer's routed experts for T tokens, each with k (expert id, weight) pairs:
   y[t] = sum over its experts e in ascending id order of weight * down[e] @ (silu(g) * u), [g; u] = gate_up[e] @ x[t].
   gate_up [E, 2I, H] (gate rows, then up rows) and down [E, H, I], as checkpoints store them; ids [T, k] int64,
   weights [T, k] float32; scratch: 3 I + H floats. */
void duet_moe_silu_f32(const float *x, int64_t T, int64_t H, int64_t I, const float *gate_up, const float *down,
                       const int64_t *ids, const float *weights, int64_t k, float *scratch, float *y) {
    float *gu = scratch, *h = scratch + 2 * I, *out = scratch + 3 * I;
    for (int64_t t = 0; t < T; t++) {
        const int64_t *id = ids + t * k;
        int64_t order[64];
        const int64_t kk = k < 64 ? k : 64;
        for (int64_t j = 0; j < kk; j++) { /* insertion sort of the slots by expert id */
            int64_t m = j;
            while (m > 0 && id[order[m - 1]] > id[j]) { order[m] = order[m - 1]; m--; }
            order[m] = j;
        }
        float *yt = y + t * H;
        for (int64_t c = 0; c < H; c++) yt[c] = 0.f;
        for (int64_t j = 0; j < kk; j++) {
            const int64_t e = id[order[j]];
            const float *wgu = gate_up + e * 2 * I * H, *wd = down + e * H * I;
            const float *next = j + 1 < kk ? gate_up + id[order[j + 1]] * 2 * I * H : NULL;
            gemv(x + t * H, 1, H, wgu, 2 * I, NULL, gu, 2 * I, wd);
            for (int64_t c = 0; c < I; c++) {
                const float g = gu[c];
                h[c] = g / (1.f + expf(-g)) * gu[I + c];
            }
            gemv(h, 1, I, wd, H, NULL, out, H, next);
            const float wj = weights[t * k + order[j]];
            for (int64_t c = 0; c < H; c++) yt[c] += out[c] * wj;
        }
    }
}
