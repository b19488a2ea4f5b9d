/* Memory-bound CPU kernels for steps of a few rows (a decode step), built on the host by engine/cpu_kernels.py.

   A decode step multiplies one or a few rows by every weight of the model once: its time is the time to read the
   weights from memory. Library GEMM kernels reach a fraction of the core's read bandwidth at one row (measured
   7-10 GB/s against 24 GB/s for a plain sum over the same bytes, AMD EPYC, float32), since they are built for reuse
   the single row does not have. These kernels read each weight row once, four rows at a time (four streams), with
   the next block of rows prefetched while the current one is summed, and keep up to four input rows' partial sums
   in registers, so that each weight line is read once for all of them.
   Float32 only; results equal a GEMM's to float rounding (the same products summed in another order). */
#include <stdlib.h>

#include "cpu_kernels.h"
#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

/* Holds values in vector registers: without it the compiler reloads each weight vector from memory for every row
   (a memory operand per multiply), and at four rows the loads, not memory, set the pace. */
#if defined(__GNUC__) && defined(__AVX512F__) /* a whole vec fits one register only with AVX-512 */
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

/* y [rows, N] = x [rows, K] @ w[N, K]^T (+ bias [N]); every array contiguous float32. Built with OpenMP (the runtime
   torch itself loaded, so the same threads), a weight of at least PAR_MIN floats is split into one contiguous range
   of blocks per thread of the caller's OpenMP thread count (torch.set_num_threads on that thread). */
#define PAR_MIN (1 << 16)
static int linear_tiled(const float *x, int64_t rows, int64_t K, const float *w, int64_t N, const float *bias,
                        float *y);
extern int64_t duet_linear_tile_rows;
void duet_linear_f32(const float *x, int64_t rows, int64_t K, const float *w, int64_t N, const float *bias,
                     float *y) {
    if (duet_linear_tile_rows > 0 && rows >= duet_linear_tile_rows && N >= 4 * VW &&
        linear_tiled(x, rows, K, w, N, bias, y) == 0)
        return;
#ifdef _OPENMP
    const int threads = omp_get_max_threads();
    if (threads > 1 && N * K >= PAR_MIN && N >= 2 * NB) {
        const int64_t blocks = N / NB;
#pragma omp parallel num_threads(threads)
        {
            const int64_t t = omp_get_thread_num(), nt = omp_get_num_threads();
            const int64_t b0 = blocks * t / nt, b1 = t == nt - 1 ? -1 : blocks * (t + 1) / nt;
            const int64_t n0 = b0 * NB, n1 = b1 < 0 ? N : b1 * NB; /* the last thread takes the remainder rows */
            gemv(x, rows, K, w + n0 * K, n1 - n0, bias ? bias + n0 : NULL, y + n0, N, NULL);
        }
        return;
    }
#endif
    gemv(x, rows, K, w, N, bias, y, N, NULL);
}

/* yT [N, ldx] = w [N, K] @ xT [K, ldx] for one tile: MR weight rows at w (rows K floats apart) by MV vectors of xT's
   columns (VW columns each). Each weight element is broadcast once and multiplied into MV vectors of columns, the
   MR * MV sums stay in registers (24 of 32 on AVX-512), so at many rows an expert's GEMM runs at the core's multiply
   rate instead of gemv's (which reads each weight once for up to four rows and sums across lanes at the end). */
#define TILE(MR, MV)                                                                                                \
    static void tile_##MR##x##MV(const float *w, int64_t K, const float *xT, int64_t ldx, float *yT) {            \
        vec acc[MR][MV];                                                                                            \
        _Pragma("GCC unroll 16") for (int i = 0; i < MR; i++)                                                       \
            _Pragma("GCC unroll 3") for (int j = 0; j < MV; j++) acc[i][j] = (vec){0};                              \
        for (int64_t k = 0; k < K; k++) {                                                                           \
            if ((k & (VW - 1)) == 0) /* the next tile's weight rows, a line each, one tile ahead of their use */    \
                _Pragma("GCC unroll 16") for (int i = 0; i < MR; i++) __builtin_prefetch(w + (MR + i) * K + k, 0, 3); \
            const float *xk = xT + k * ldx;                                                                         \
            vec xv[MV];                                                                                             \
            _Pragma("GCC unroll 3") for (int j = 0; j < MV; j++) xv[j] = load(xk + j * VW);                         \
            _Pragma("GCC unroll 16") for (int i = 0; i < MR; i++) {                                                 \
                const vec b = splat(w[i * K + k]);                                                              \
                _Pragma("GCC unroll 3") for (int j = 0; j < MV; j++) acc[i][j] += b * xv[j];                        \
            }                                                                                                       \
        }                                                                                                           \
        _Pragma("GCC unroll 16") for (int i = 0; i < MR; i++)                                                       \
            _Pragma("GCC unroll 3") for (int j = 0; j < MV; j++) memcpy(yT + i * ldx + j * VW, &acc[i][j], sizeof(vec)); \
    }
#ifdef __AVX512F__ /* 32 vector registers: tiles of 24 sums */
TILE(8, 3)
TILE(12, 2)
TILE(4, 2)
TILE(16, 1)
#define ROWS_ONE 16
#define TILE_ONE tile_16x1
#else /* 16 registers of half a vec each: tiles of 4 x 1 (8 registers of sums) */
TILE(4, 1)
#define ROWS_ONE 4
#define TILE_ONE tile_4x1
#endif
TILE(1, 1)

/* One band of MV column vectors starting at column vector v: tiles of R weight rows, then of RR, then single rows. */
#define BAND(TILE_FN, R, REST_FN, RR, MV)                                                                           \
    do {                                                                                                            \
        int64_t n = 0;                                                                                              \
        for (; n + (R) <= N; n += (R)) TILE_FN(w + n * K, K, xT + v * VW, ldx, yT + n * ldx + v * VW);               \
        for (; n + (RR) <= N; n += (RR)) REST_FN(w + n * K, K, xT + v * VW, ldx, yT + n * ldx + v * VW);             \
        for (; n < N; n++)                                                                                          \
            for (int64_t j = 0; j < (MV); j++) tile_1x1(w + n * K, K, xT + (v + j) * VW, ldx, yT + n * ldx + (v + j) * VW); \
        v += (MV);                                                                                                  \
    } while (0)

/* yT [N, ldx] = w [N, K] @ xT [K, ldx], ldx a multiple of VW: bands of the widest tile the remaining columns take. */
static void gemm_t(const float *w, int64_t N, int64_t K, const float *xT, int64_t ldx, float *yT) {
    const int64_t nv = ldx / VW;
    int64_t v = 0;
#ifdef __AVX512F__
    while (v + 3 <= nv) BAND(tile_8x3, 8, tile_8x3, 8, 3);
    if (v + 2 <= nv) BAND(tile_12x2, 12, tile_4x2, 4, 2);
#endif
    while (v < nv) BAND(TILE_ONE, ROWS_ONE, TILE_ONE, ROWS_ONE, 1);
}

/* The n <= VW rows at rows[] (K floats each) as VW columns of xT [K, ldx] (column r = row r, zeros from n on):
   the tiled GEMM's operand layout. */
static void columns_of(const float *const *rows, int64_t n, int64_t K, float *xT, int64_t ldx) {
    for (int64_t c0 = 0; c0 + VW <= K; c0 += VW) {
        vec blk[VW];
        for (int64_t r = 0; r < VW; r++) blk[r] = r < n ? load(rows[r] + c0) : (vec){0};
        transpose_block((const float *)blk, VW, VW, xT + c0 * ldx, ldx, VW);
    }
    for (int64_t c = K / VW * VW; c < K; c++)
        for (int64_t r = 0; r < VW; r++) xT[c * ldx + r] = r < n ? rows[r][c] : 0.f;
}

/* y [rows, N] = x [rows, K] @ w [N, K]^T (+ bias) by the tiled GEMM: x transposed into xT [K, ldx] (ldx = rows
   rounded up to whole vectors, zeros beyond), yT = w @ xT by gemm_t, then yT transposed back. At a decode step of
   16-64 rows a projection is bound by multiplies, not memory, and gemv (each weight vector times at most four
   rows, summed across lanes at the end) reaches about half the rate of gemm_t's register tiles. With OpenMP the
   weight rows are split among the threads in whole vectors. Returns 0, or -1 where its scratch could not be had
   (the caller falls back to gemv). duet_linear_f32 takes it from duet_linear_tile_rows rows (set at load by timing
   both, engine.cpu_linear.choose_tile_rows) for weights of at least 64 rows (a router of 16 gains nothing). */
static int linear_tiled(const float *x, int64_t rows, int64_t K, const float *w, int64_t N, const float *bias,
                        float *y) {
    const int64_t ldx = (rows + VW - 1) / VW * VW;
    float *xT = malloc((size_t)(K + N) * ldx * sizeof(float));
    if (!xT) return -1;
    float *yT = xT + K * ldx;
    const float *xr[VW];
    for (int64_t r0 = 0; r0 < ldx; r0 += VW) {
        const int64_t n = rows - r0 < VW ? rows - r0 : VW;
        for (int64_t r = 0; r < n; r++) xr[r] = x + (r0 + r) * K;
        columns_of(xr, n, K, xT + r0, ldx);
    }
    const int64_t blocks = (N + VW - 1) / VW;
#ifdef _OPENMP
    const int threads = omp_get_max_threads() > 1 && blocks > 1 ? omp_get_max_threads() : 1;
#pragma omp parallel num_threads(threads) if (threads > 1)
#endif
    {
#ifdef _OPENMP
        const int64_t t = omp_get_thread_num(), nt = omp_get_num_threads();
#else
        const int64_t t = 0, nt = 1;
#endif
        const int64_t n0 = blocks * t / nt * VW, n1e = blocks * (t + 1) / nt * VW, n1 = n1e < N ? n1e : N;
        if (n1 > n0) {
            gemm_t(w + n0 * K, n1 - n0, K, xT, ldx, yT + n0 * ldx);
            int64_t n = n0;
            for (; n + VW <= n1; n += VW)
                for (int64_t r0 = 0; r0 < rows; r0 += VW)
                    transpose_block(yT + n * ldx + r0, ldx, VW, y + r0 * N + n, N, rows - r0 < VW ? rows - r0 : VW);
            for (; n < n1; n++)
                for (int64_t r = 0; r < rows; r++) y[r * N + n] = yT[n * ldx + r];
            if (bias)
                for (int64_t r = 0; r < rows; r++)
                    for (int64_t c = n0; c < n1; c++) y[r * N + c] += bias[c];
        }
    }
    free(xT);
    return 0;
}

int64_t duet_linear_tile_rows = 0; /* rows from which duet_linear_f32 takes linear_tiled (0: never); set at load */

void duet_set_linear_tile_rows(int64_t rows) { duet_linear_tile_rows = rows; }

/* he [m, I] = silu(g) * u of ge [m, 2I] rows [g; u] (gemv's layout), VW lanes at a time by vexp (a scalar expf
   per element cost more than the experts' multiplies at 32 rows an expert). */
static void silu_mul(const float *ge, int64_t m, int64_t I, float *he) {
    const int64_t iv = I & ~(int64_t)(VW - 1);
    for (int64_t r = 0; r < m; r++) {
        const float *g = ge + r * 2 * I, *u = g + I;
        float *o = he + r * I;
        for (int64_t c = 0; c < iv; c += VW) {
            const vec gv = load(g + c), s = gv / (1.f + vexp(-gv)) * load(u + c);
            memcpy(o + c, &s, sizeof s);
        }
        for (int64_t c = iv; c < I; c++) o[c] = g[c] / (1.f + expf(-g[c])) * u[c];
    }
}

#ifndef TAIL_ROWS
#define TAIL_ROWS 6 /* rows past a whole vector that gemv takes rather than a zero-padded vector of the tiled path */
#endif

/* Scratch floats duet_moe_silu_f32 takes for T tokens of k experts each out of E: every expert with tokens gets
   (2H + 3I) floats per row, the rows of one with at least tile_min (>= 1) of them rounded up to whole vectors (its
   tiled path's columns; at most min(E, T k / tile_min) experts), so a decode step's experts take no padding. */
int64_t duet_moe_silu_scratch(int64_t T, int64_t H, int64_t I, int64_t E, int64_t k, int64_t tile_min) {
    const int64_t P = T * k, tiled = P / (tile_min > 1 ? tile_min : 1);
    return (P + (VW - 1) * (E < tiled ? E : tiled)) * (2 * H + 3 * I);
}

/* A SwiGLU MoE layer's routed experts for T tokens, each with k (expert id, weight) pairs:
   y[t] = sum over its experts e in ascending id order of weight * down[e] @ (silu(g) * u), [g; u] = gate_up[e] @ x[t].
   gate_up [E, 2I, H] (gate rows, then up rows) and down [E, H, I], as checkpoints store them; ids [T, k] int64 in
   [0, E) (the caller checks), weights [T, k] float32. The pairs are grouped by expert (a counting sort, stable in
   token order) and each expert with tokens runs once over all of them, so its weights are read once per step. An
   expert with fewer than tile_min rows multiplies them by gemv (the next expert's first block prefetched while one
   finishes); one with more takes the tiled path: its rows are gathered transposed (xT [H, m'], m' = m rounded up to
   whole vectors, zero beyond m), gT = gate_up @ xT, hT = silu(gT's gate rows) * its up rows, oT = down @ hT, each by
   gemm_t. With OpenMP the experts are shared among the caller's threads (each writes only its experts' scratch),
   then each token sums its rows in expert order, so the result does not depend on the thread count.
   fscratch: duet_moe_silu_scratch(T, H, I, E, k, tile_min) floats; iscratch: 4 E + 2 T k. */
/* An expert's products over its weights as they are stored: in panels (cpu_panels.c) or row-major. */
#define EXPERT_GEMV(x, rows, K, w, N, y, ldy, after) \
    (panel ? panel_gemv(x, rows, K, w, N, y, ldy) : gemv(x, rows, K, w, N, NULL, y, ldy, after))

void duet_moe_silu_f32(const float *x, int64_t T, int64_t H, int64_t I, int64_t E, const float *gate_up,
                       const float *down, const int64_t *ids, const float *weights, int64_t k, int64_t tile_min,
                       int panel, float *fscratch, int64_t *iscratch, float *y) {
    const int64_t P = T * k, per_row = 2 * H + 3 * I;
    if (panel) tile_min = INT64_MAX; /* panel_gemv is itself a register-tiled GEMM at many rows: no transposes */
    int64_t *start = iscratch, *active = iscratch + E, *region = active + E, *ld = region + E, *pairs = ld + E,
            *pos = pairs + P;
    for (int64_t e = 0; e < E; e++) start[e] = 0;
    for (int64_t p = 0; p < P; p++) start[ids[p]]++;
    int64_t na = 0, nt = 0;
    for (int64_t e = 0, acc = 0; e < E; e++) {
        const int64_t c = start[e], tail = c % VW;
        /* the tiled path's row stride (0: gemv's layout): whole vectors of rows, a last one padded with zeros unless
           at most TAIL_ROWS rows spill over a whole vector, which gemv takes (a padded vector costs a whole one) */
        ld[e] = c < tile_min ? 0 : tail <= TAIL_ROWS && c - tail >= tile_min ? c - tail : (c + VW - 1) / VW * VW;
        region[e] = (acc + (VW - 1) * nt) * per_row;
        nt += ld[e] > 0;
        if (c) active[na++] = e;
        start[e] = acc;
        acc += c;
    }
    for (int64_t p = 0; p < P; p++) { pos[p] = start[ids[p]]; pairs[start[ids[p]]++] = p; } /* start[e]: e's end */
#ifdef _OPENMP
    const int threads = na > 1 ? omp_get_max_threads() : 1;
    if (threads > 1 && na <= 256) /* the busiest experts first, so the last ones the threads take are short */
        for (int64_t a = 1; a < na; a++) {
            const int64_t e = active[a], c = start[e] - (e ? start[e - 1] : 0);
            int64_t q = a;
            for (; q > 0 && start[active[q - 1]] - (active[q - 1] ? start[active[q - 1] - 1] : 0) < c; q--)
                active[q] = active[q - 1];
            active[q] = e;
        }
#pragma omp parallel for schedule(dynamic, 1) num_threads(threads) if (threads > 1)
#endif
    for (int64_t a = 0; a < na; a++) {
        const int64_t e = active[a], end = start[e], begin = e ? start[e - 1] : 0, m = end - begin;
        const int64_t *pe = pairs + begin;
        const float *wgu = gate_up + e * 2 * I * H, *wd = down + e * H * I;
        float *base = fscratch + region[e];
        if (ld[e]) {
            const int64_t lx = ld[e], mt = lx < m ? lx : m; /* rows of the tiled path; gemv takes the m - mt after */
            float *xT = base, *gT = xT + H * lx, *hT = gT + 2 * I * lx, *oT = hT + I * lx;
            const float *rows[VW];
            for (int64_t r0 = 0; r0 < lx; r0 += VW) { /* gathered and transposed VW tokens at a time */
                const int64_t n = mt - r0 < VW ? mt - r0 : VW;
                for (int64_t r = 0; r < n; r++) rows[r] = x + (pe[r0 + r] / k) * H;
                columns_of(rows, n, H, xT + r0, lx);
            }
            gemm_t(wgu, 2 * I, H, xT, lx, gT);
            for (int64_t c = 0; c < I; c++)
                for (int64_t r = 0; r < lx; r += VW) {
                    const vec g = load(gT + c * lx + r), u = load(gT + (I + c) * lx + r);
                    const vec s = g / (1.f + vexp(-g)) * u;
                    memcpy(hT + c * lx + r, &s, sizeof s);
                }
            gemm_t(wd, H, I, hT, lx, oT);
            float *o = xT; /* the rows' outputs [m, H], in xT's place (H lx >= mt H floats) */
            for (int64_t r0 = 0; r0 < mt; r0 += VW) {
                const int64_t n = mt - r0 < VW ? mt - r0 : VW;
                for (int64_t c0 = 0; c0 + VW <= H; c0 += VW) transpose_block(oT + c0 * lx + r0, lx, VW, o + r0 * H + c0, H, n);
                for (int64_t c = H / VW * VW; c < H; c++)
                    for (int64_t r = 0; r < n; r++) o[(r0 + r) * H + c] = oT[c * lx + r0 + r];
            }
            if (mt < m) { /* the tail rows by gemv, in the scratch past the tiled path's (m - mt rows of per_row) */
                const int64_t mr = m - mt;
                float *xe = base + lx * per_row, *ge = xe + mr * H, *he = ge + mr * 2 * I, *oe = he + mr * I;
                for (int64_t r = 0; r < mr; r++) memcpy(xe + r * H, x + (pe[mt + r] / k) * H, H * sizeof(float));
                EXPERT_GEMV(xe, mr, H, wgu, 2 * I, ge, 2 * I, wd);
                silu_mul(ge, mr, I, he);
                EXPERT_GEMV(he, mr, I, wd, H, oe, H, NULL);
                /* after the tiled outputs: [mt H, m H) lies in gT / hT / oT (done with) and ends before xe */
                memcpy(o + mt * H, oe, mr * H * sizeof(float));
            }
        } else {
            float *xe = base, *ge = xe + m * H, *he = ge + m * 2 * I, *oe = he + m * I;
            const float *after = a + 1 < na ? gate_up + active[a + 1] * 2 * I * H : NULL;
            for (int64_t r = 0; r < m; r++) memcpy(xe + r * H, x + (pe[r] / k) * H, H * sizeof(float));
            EXPERT_GEMV(xe, m, H, wgu, 2 * I, ge, 2 * I, wd);
            silu_mul(ge, m, I, he);
            EXPERT_GEMV(he, m, I, wd, H, oe, H, after);
        }
    }
    /* a token's rows lie in ascending expert order in the sorted pairs: sum them in that order */
#ifdef _OPENMP
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1 && T > 1)
#endif
    for (int64_t t = 0; t < T; t++) {
        int64_t order[64];
        const int64_t kk = k < 64 ? k : 64;
        for (int64_t j = 0; j < kk; j++) { /* the token's pairs by position (= by expert id) */
            int64_t q = j;
            while (q > 0 && pos[t * k + order[q - 1]] > pos[t * k + j]) { order[q] = order[q - 1]; q--; }
            order[q] = j;
        }
        float *yt = y + t * H;
        for (int64_t c = 0; c < H; c++) yt[c] = 0.f;
        for (int64_t j = 0; j < kk; j++) {
            const int64_t p = t * k + order[j], e = ids[p], r = pos[p] - (e ? start[e - 1] : 0);
            const float w = weights[p];
            const int64_t m = start[e] - (e ? start[e - 1] : 0);
            const float *o = fscratch + region[e] + (ld[e] ? 0 : m * (H + 3 * I)) + r * H; /* see the expert loop */
            for (int64_t c = 0; c < H; c++) yt[c] += o[c] * w;
        }
    }
}

/* RMSNorm of float32 rows: y[r] = x[r] / sqrt(mean(x[r]^2) + eps) * w[r % wrows] (w: wrows x H; per-head norms pass
   one weight row per head), the sum of squares in float32 as torch's float32 path takes it. */
void duet_rms_norm_f32(const float *x, int64_t rows, int64_t H, const float *w, int64_t wrows, float eps, float *y) {
    const int64_t hv = H & ~(int64_t)(VW - 1);
#ifdef _OPENMP
#pragma omp parallel for schedule(static) if (rows * H >= PAR_MIN && omp_get_max_threads() > 1)
#endif
    for (int64_t r = 0; r < rows; r++) {
        const float *xr = x + r * H, *wr = w + (r % wrows) * H;
        float *yr = y + r * H;
        vec acc = (vec){0};
        for (int64_t c = 0; c < hv; c += VW) { const vec v = load(xr + c); acc += v * v; }
        float ss = hsum(acc);
        for (int64_t c = hv; c < H; c++) ss += xr[c] * xr[c];
        const float inv = 1.f / sqrtf(ss / (float)H + eps);
        for (int64_t c = 0; c < H; c++) yr[c] = xr[c] * inv * wr[c];
    }
}

/* x + r into s, then s's RMSNorm into y (the residual add before a layer's second norm, one pass for both). */
void duet_add_rms_norm_f32(const float *x, const float *r, int64_t rows, int64_t H, const float *w, float eps,
                           float *s, float *y) {
    const int64_t hv = H & ~(int64_t)(VW - 1);
#ifdef _OPENMP
#pragma omp parallel for schedule(static) if (rows * H >= PAR_MIN && omp_get_max_threads() > 1)
#endif
    for (int64_t i = 0; i < rows; i++) {
        const float *xr = x + i * H, *rr = r + i * H;
        float *sr = s + i * H, *yr = y + i * H;
        vec acc = (vec){0};
        for (int64_t c = 0; c < hv; c += VW) {
            const vec v = load(xr + c) + load(rr + c);
            memcpy(sr + c, &v, sizeof v);
            acc += v * v;
        }
        float ss = hsum(acc);
        for (int64_t c = hv; c < H; c++) { sr[c] = xr[c] + rr[c]; ss += sr[c] * sr[c]; }
        const float inv = 1.f / sqrtf(ss / (float)H + eps);
        for (int64_t c = 0; c < H; c++) yr[c] = sr[c] * inv * w[c];
    }
}

/* In place on x [T, R, D]: each head row's RMSNorm (weight w [R, D], or none when w is NULL), then rotary:
   x * cos + roll(x, D / 2) * sin_signed, with cos and sin_signed [T, D] (the first half of sin negated, so that
   rotate_half is a roll). D even. */
static void norm_rope(float *x, int64_t T, int64_t ldx, int64_t R, int64_t D, const float *w, float eps,
                      const float *cos_t, const float *sin_t) {
    const int64_t half = D / 2;
    for (int64_t t = 0; t < T; t++) {
        const float *ct = cos_t + t * D, *st = sin_t + t * D;
        for (int64_t r = 0; r < R; r++) {
            float *xr = x + t * ldx + r * D;
            float tmp[D];
            if (w) {
                float ss = 0.f;
                for (int64_t c = 0; c < D; c++) ss += xr[c] * xr[c];
                const float inv = 1.f / sqrtf(ss / (float)D + eps);
                const float *wr = w + r * D;
                for (int64_t c = 0; c < D; c++) tmp[c] = xr[c] * inv * wr[c];
            } else {
                memcpy(tmp, xr, D * sizeof(float));
            }
            for (int64_t c = 0; c < half; c++) xr[c] = tmp[c] * ct[c] + tmp[c + half] * st[c];
            for (int64_t c = half; c < D; c++) xr[c] = tmp[c] * ct[c] + tmp[c - half] * st[c];
        }
    }
}

void duet_norm_rope_f32(float *x, int64_t T, int64_t R, int64_t D, const float *w, float eps, const float *cos_t,
                        const float *sin_t) {
    norm_rope(x, T, R * D, R, D, w, eps, cos_t, sin_t);
}

/* sc[i] = exp(sc[i] - mx) for i < n, VW at a time (vexp); returns their sum. A scalar expf per score took more of a
   32-sequence decode step's attention than its key and value reads. */
static float softmax_exp(float *sc, int64_t n, float mx) {
    const int64_t nv = n & ~(int64_t)(VW - 1);
    vec acc = (vec){0};
    for (int64_t i = 0; i < nv; i += VW) {
        const vec e = vexp(load(sc + i) - splat(mx));
        memcpy(sc + i, &e, sizeof e);
        acc += e;
    }
    float sum = hsum(acc);
    for (int64_t i = nv; i < n; i++) { sc[i] = expf(sc[i] - mx); sum += sc[i]; }
    return sum;
}

/* sc[i] = scale * q . k[i] for i < L (keys rows NV * VW floats apart, q in NV registers), 16 keys at a time
   reduced by fold16 (30 shuffles where a lane sum per key takes 64); returns the largest. */
#define SCORES(NV)                                                                                                  \
    static float scores_##NV(const float *q, const float *kb, int64_t L, float scale, float *sc) {                 \
        vec qv[NV];                                                                                                 \
        _Pragma("GCC unroll 8") for (int c = 0; c < NV; c++) qv[c] = load(q + c * VW);                              \
        vec mv = splat(-INFINITY);                                                                                  \
        int64_t i = 0;                                                                                              \
        for (; i + VW <= L; i += VW) {                                                                              \
            vec a[VW];                                                                                              \
            _Pragma("GCC unroll 16") for (int t = 0; t < VW; t++) {                                                 \
                const float *k = kb + (i + t) * NV * VW;                                                            \
                vec acc = qv[0] * load(k);                                                                          \
                _Pragma("GCC unroll 8") for (int c = 1; c < NV; c++) acc += qv[c] * load(k + c * VW);               \
                a[t] = acc;                                                                                         \
            }                                                                                                       \
            const vec sv = fold16(a) * scale;                                                                       \
            memcpy(sc + i, &sv, sizeof sv);                                                                         \
            mv = vmax(sv, mv);                                                                                      \
        }                                                                                                           \
        float mx = hmax(mv);                                                                                        \
        for (; i < L; i++) {                                                                                        \
            const float *k = kb + i * NV * VW;                                                                      \
            vec acc = qv[0] * load(k);                                                                              \
            _Pragma("GCC unroll 8") for (int c = 1; c < NV; c++) acc += qv[c] * load(k + c * VW);                   \
            sc[i] = hsum(acc) * scale;                                                                              \
            if (sc[i] > mx) mx = sc[i];                                                                             \
        }                                                                                                           \
        return mx;                                                                                                  \
    }
SCORES(4)
SCORES(8)

/* oh [NV * VW] = sum over i < L of p[i] * inv * v[i] (rows NV * VW floats apart), the sums in NV registers. */
#define WEIGH(NV)                                                                                                   \
    static void weigh_values_##NV(const float *p, int64_t L, const float *v, float inv, float *oh) {               \
        vec acc[NV];                                                                                                \
        _Pragma("GCC unroll 8") for (int c = 0; c < NV; c++) acc[c] = (vec){0};                                     \
        for (int64_t i = 0; i < L; i++) {                                                                           \
            const vec w = splat(p[i] * inv);                                                                        \
            _Pragma("GCC unroll 8") for (int c = 0; c < NV; c++) acc[c] += w * load(v + i * NV * VW + c * VW);       \
        }                                                                                                           \
        _Pragma("GCC unroll 8") for (int c = 0; c < NV; c++) memcpy(oh + c * VW, &acc[c], sizeof(vec));             \
    }
WEIGH(4)
WEIGH(8)

/* VW uint8 codes as floats. The intrinsics: GCC turns __builtin_convertvector of a byte vector into a scalar
   convert per byte (5x slower attention over coded pages than over float keys, where these take one or two). */
static inline vec load_u8(const uint8_t *p) {
#if defined(__AVX512F__)
    const __m512 f = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)p)));
#elif defined(__AVX2__)
    const __m128i c = _mm_loadu_si128((const __m128i *)p);
    const __m256 f[2] = {_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(c)),
                         _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(c, 8)))};
#else
    float f[VW];
    for (int i = 0; i < VW; i++) f[i] = p[i];
#endif
    vec v;
    memcpy(&v, &f, sizeof v);
    return v;
}

/* Coded visual pages (engine.coded_kv): a page holds up to PG tokens of one sequence in one pool block's memory,
   per layer. K page: min [KVH, D], scale [KVH, D] (float32, per channel over the page's tokens), codes uint8
   [KVH, PG, D]; V page: min [KVH, PG], scale [KVH, PG] (per token and head), codes [KVH, PG, D]; a value is
   min + scale * code. Scores need no dequantized keys: q . k_t = q . min + (q * scale) . code_t, and values
   sum_t p_t v_t = sum_t p_t min_t + sum_t (p_t scale_t) code_t. A KV head's codes are turned into floats once
   per chunk of CHUNK tokens (in L1) and read by every query head of its group with the plain kernels. */
#define PAGE_MAX_D 256
#define CHUNK 64
#define MAX_GROUP 64 /* query heads per KV head */

/* dst [n, D] floats = codes [n, D] (uint8). */
static void codes_to_float(const uint8_t *codes, int64_t n, int64_t D, float *dst) {
    const int64_t m = n * D, mv = m & ~(int64_t)(VW - 1);
    for (int64_t i = 0; i < mv; i += VW) {
        const vec f = load_u8(codes + i);
        memcpy(dst + i, &f, sizeof f);
    }
    for (int64_t i = mv; i < m; i++) dst[i] = codes[i];
}

/* sc[i] = qs . c[i] + base for i < n (c: n rows of D floats); returns the largest. */
static float chunk_scores(const float *qs, const float *c, int64_t n, int64_t D, float base, float *sc) {
    float mx;
    if (D == 64) mx = scores_4(qs, c, n, 1.f, sc);
    else if (D == 128) mx = scores_8(qs, c, n, 1.f, sc);
    else {
        const int64_t dv = D & ~(int64_t)(VW - 1);
        mx = -INFINITY;
        for (int64_t i = 0; i < n; i++) {
            vec acc = (vec){0};
            for (int64_t k = 0; k < dv; k += VW) acc += load(qs + k) * load(c + i * D + k);
            float s = hsum(acc);
            for (int64_t k = dv; k < D; k++) s += qs[k] * c[i * D + k];
            sc[i] = s;
            if (s > mx) mx = s;
        }
    }
    for (int64_t i = 0; i < n; i++) sc[i] += base;
    return mx + base;
}

/* oh [D] += sum over i < n of w[i] * c[i] (c: n rows of D floats). */
static void chunk_values(const float *w, const float *c, int64_t n, int64_t D, float *oh) {
    const int64_t dv = D & ~(int64_t)(VW - 1);
    for (int64_t k = 0; k < dv; k += VW) {
        vec acc = load(oh + k);
        for (int64_t i = 0; i < n; i++) acc += splat(w[i]) * load(c + i * D + k);
        memcpy(oh + k, &acc, sizeof acc);
    }
    for (int64_t k = dv; k < D; k++)
        for (int64_t i = 0; i < n; i++) oh[k] += w[i] * c[i * D + k];
}

/* Scores of query heads qh[g] (g < G) over KV head j's coded pages p0 .. p1 - 1 into sc[g] + 0 ..; mx[g] is raised
   to their largest. */
static void coded_scores(const float *const *qh, int64_t G, float scale, const float *page_k, int64_t page_floats,
                         const int64_t *pblk, const int64_t *pn, int64_t p0, int64_t p1, int64_t KVH, int64_t j,
                         int64_t D, int64_t PG, float *const *sc, float *mx) {
    float cf[CHUNK * PAGE_MAX_D], qs[MAX_GROUP][PAGE_MAX_D], base[MAX_GROUP];
    int64_t off = 0;
    for (int64_t p = p0; p < p1; p++) {
        const uint8_t *kp = (const uint8_t *)(page_k + pblk[p] * page_floats);
        const float *mn = (const float *)kp + j * D, *sk = (const float *)kp + KVH * D + j * D;
        const uint8_t *codes = kp + 8 * KVH * D + j * PG * D;
        for (int64_t g = 0; g < G; g++) {
            float b = 0.f;
            for (int64_t c = 0; c < D; c++) { qs[g][c] = qh[g][c] * sk[c] * scale; b += qh[g][c] * mn[c]; }
            base[g] = b * scale;
        }
        for (int64_t t = 0; t < pn[p]; t += CHUNK) {
            const int64_t n = pn[p] - t < CHUNK ? pn[p] - t : CHUNK;
            codes_to_float(codes + t * D, n, D, cf);
            for (int64_t g = 0; g < G; g++) {
                const float m = chunk_scores(qs[g], cf, n, D, base[g], sc[g] + off + t);
                if (m > mx[g]) mx[g] = m;
            }
        }
        off += pn[p];
    }
}

/* oh[g] += softmax weights p[g] (scaled by inv[g]) times KV head j's coded values of pages p0 .. p1 - 1. */
static void coded_values(const float *const *p, const float *inv, int64_t G, const float *page_v, int64_t page_floats,
                         const int64_t *pblk, const int64_t *pn, int64_t p0, int64_t p1, int64_t KVH, int64_t j,
                         int64_t D, int64_t PG, float *const *oh) {
    float cf[CHUNK * PAGE_MAX_D], w[CHUNK];
    int64_t off = 0;
    for (int64_t q = p0; q < p1; q++) {
        const uint8_t *vp = (const uint8_t *)(page_v + pblk[q] * page_floats);
        const float *mn = (const float *)vp + j * PG, *sv = (const float *)vp + KVH * PG + j * PG;
        const uint8_t *codes = vp + 8 * KVH * PG + j * PG * D;
        for (int64_t t = 0; t < pn[q]; t += CHUNK) {
            const int64_t n = pn[q] - t < CHUNK ? pn[q] - t : CHUNK;
            codes_to_float(codes + t * D, n, D, cf);
            for (int64_t g = 0; g < G; g++) {
                const float *pg = p[g] + off + t;
                float b = 0.f;
                for (int64_t i = 0; i < n; i++) {
                    const float x = pg[i] * inv[g];
                    w[i] = x * sv[t + i];
                    b += x * mn[t + i];
                }
                chunk_values(w, cf, n, D, oh[g]);
                for (int64_t c = 0; c < D; c++) oh[g][c] += b;
            }
        }
        off += pn[q];
    }
}

/* Decode attention, one query token per sequence. For each b < B: its keys and values k_new[b], v_new[b] [KVH, D]
   (rows ldk / ldv floats apart) are written at position pos[b] of mirror row slots[b] (mirror_k / mirror_v [S,
   KVH, cap, D]) and, when pool_k is not NULL, at pool slot pool_slots[b] of the paged pool (pool_k / pool_v [*,
   KVH, D]); then each query head h of q [B, H, D] (rows ldq floats apart) attends over that row's positions
   0..pos[b] (its KV head is h / (H / KVH)), softmax in float32 with the running max subtracted. out [B, H, D].
   With poff (else NULL), row b also attends over its coded pages poff[b] .. poff[b + 1] - 1 (coded_scores): page
   p holds pn[p] tokens in pool block pblk[p] of page_k / page_v (the layer's pool, page_floats floats a block; PG
   tokens a page at most; D <= PAGE_MAX_D), one softmax over both. scratch: B * H * lds floats (the scores; lds >=
   every pos[b] + 1 plus its coded tokens). With OpenMP the (sequence, KV head) pairs are shared among the threads
   when the step reads enough keys to pay for it. */
void duet_decode_attention_f32(const float *q, int64_t ldq, const float *k_new, int64_t ldk, const float *v_new,
                               int64_t ldv, float *mirror_k, float *mirror_v, const int64_t *slots,
                               const int64_t *pos, float *pool_k, float *pool_v, const int64_t *pool_slots, int64_t B,
                               int64_t H, int64_t KVH, int64_t D, int64_t cap, float scale, float *scratch,
                               int64_t lds, float *out, const float *page_k, const float *page_v, int64_t page_floats,
                               int64_t PG, const int64_t *poff, const int64_t *pblk, const int64_t *pn) {
    const int64_t G = H / KVH, dv = D & ~(int64_t)(VW - 1);
    int64_t keys = 0;
    for (int64_t b = 0; b < B; b++) {
        for (int64_t j = 0; j < KVH; j++) {
            const int64_t m = ((slots[b] * KVH + j) * cap + pos[b]) * D;
            memcpy(mirror_k + m, k_new + b * ldk + j * D, D * sizeof(float));
            memcpy(mirror_v + m, v_new + b * ldv + j * D, D * sizeof(float));
        }
        if (pool_k) {
            memcpy(pool_k + pool_slots[b] * KVH * D, k_new + b * ldk, KVH * D * sizeof(float));
            memcpy(pool_v + pool_slots[b] * KVH * D, v_new + b * ldv, KVH * D * sizeof(float));
        }
        keys += pos[b] + 1;
        if (poff)
            for (int64_t p = poff[b]; p < poff[b + 1]; p++) keys += pn[p];
    }
#ifdef _OPENMP
    const int par = B * KVH > 1 && keys * KVH * D >= PAR_MIN && omp_get_max_threads() > 1;
#pragma omp parallel for schedule(dynamic, 1) if (par)
#endif
    for (int64_t bj = 0; bj < B * KVH; bj++) {
        const int64_t b = bj / KVH, j = bj % KVH, L = pos[b] + 1;
        const float *kb = mirror_k + (slots[b] * KVH + j) * cap * D, *vb = mirror_v + (slots[b] * KVH + j) * cap * D;
        for (int64_t g0 = 0; g0 < G; g0 += MAX_GROUP) { /* a KV head's query heads, MAX_GROUP at a time */
            const int64_t gn = G - g0 < MAX_GROUP ? G - g0 : MAX_GROUP;
            const float *qh[MAX_GROUP];
            float *sc[MAX_GROUP], *oh[MAX_GROUP], mx[MAX_GROUP], inv[MAX_GROUP];
            int64_t nc = 0;
            for (int64_t g = 0; g < gn; g++) {
                const int64_t h = j * G + g0 + g;
                qh[g] = q + b * ldq + h * D;
                sc[g] = scratch + (b * H + h) * lds;
                oh[g] = out + (b * H + h) * D;
                if (D == 64) mx[g] = scores_4(qh[g], kb, L, scale, sc[g]);
                else if (D == 128) mx[g] = scores_8(qh[g], kb, L, scale, sc[g]);
                else {
                    mx[g] = -INFINITY;
                    for (int64_t i = 0; i < L; i++) {
                        const float *ki = kb + i * D;
                        vec acc = (vec){0};
                        for (int64_t c = 0; c < dv; c += VW) acc += load(qh[g] + c) * load(ki + c);
                        float s = hsum(acc);
                        for (int64_t c = dv; c < D; c++) s += qh[g][c] * ki[c];
                        s *= scale;
                        sc[g][i] = s;
                        if (s > mx[g]) mx[g] = s;
                    }
                }
            }
            if (poff) {
                float *csc[MAX_GROUP];
                for (int64_t g = 0; g < gn; g++) csc[g] = sc[g] + L;
                coded_scores(qh, gn, scale, page_k, page_floats, pblk, pn, poff[b], poff[b + 1], KVH, j, D, PG, csc, mx);
                for (int64_t p = poff[b]; p < poff[b + 1]; p++) nc += pn[p];
            }
            for (int64_t g = 0; g < gn; g++) {
                inv[g] = 1.f / softmax_exp(sc[g], L + nc, mx[g]);
                if (D == 64) weigh_values_4(sc[g], L, vb, inv[g], oh[g]);
                else if (D == 128) weigh_values_8(sc[g], L, vb, inv[g], oh[g]);
                else {
                    for (int64_t c = 0; c < D; c++) oh[g][c] = 0.f;
                    for (int64_t i = 0; i < L; i++) {
                        const float p = sc[g][i] * inv[g], *vi = vb + i * D;
                        for (int64_t c = 0; c < D; c++) oh[g][c] += p * vi[c];
                    }
                }
            }
            if (poff) {
                const float *csc[MAX_GROUP];
                for (int64_t g = 0; g < gn; g++) csc[g] = sc[g] + L;
                coded_values(csc, inv, gn, page_v, page_floats, pblk, pn, poff[b], poff[b + 1], KVH, j, D, PG, oh);
            }
        }
    }
}

/* A MoE router for T tokens: logits = x [T, H] @ gate [E, H]^T, softmax in float32, the k largest (ties to the
   lower id, in descending order) into ids [T, k] and their probabilities into weights [T, k], renormalized to sum
   to one when norm; counts [E] += each expert's picks. logits: T * E floats of scratch. */
#define TAKEN (-1.f) /* below every probability */
void duet_moe_route_f32(const float *x, int64_t T, int64_t H, const float *gate, int64_t E, int64_t k, int norm,
                        float *logits, float *weights, int64_t *ids, int64_t *counts) {
    duet_linear_f32(x, T, H, gate, E, NULL, logits);
    for (int64_t t = 0; t < T; t++) {
        float *l = logits + t * E;
        float mx = -INFINITY;
        for (int64_t e = 0; e < E; e++) if (l[e] > mx) mx = l[e];
        float z = 0.f;
        for (int64_t e = 0; e < E; e++) { l[e] = expf(l[e] - mx); z += l[e]; }
        for (int64_t e = 0; e < E; e++) l[e] /= z;
        float picked = 0.f;
        for (int64_t j = 0; j < k; j++) {
            int64_t best = -1; /* the first id not taken, then any larger (a NaN never is: the id stays valid) */
            for (int64_t e = 0; e < E; e++)
                if (l[e] != TAKEN && (best < 0 || l[e] > l[best])) best = e;
            ids[t * k + j] = best;
            weights[t * k + j] = l[best];
            picked += l[best];
            l[best] = TAKEN;
            counts[best]++;
        }
        if (norm)
            for (int64_t j = 0; j < k; j++) weights[t * k + j] /= picked;
    }
}

/* One decoder layer (pre-norm attention, then a SwiGLU MLP or routed experts) for a decode step of B sequences, one
   token each, in one call: the step's per-op overhead at a few rows is larger than the layer's arithmetic.
     h = rmsnorm(x) ln1; [q k v] = h Wqkv^T (+ bqkv); q, k per-head norm (qk_norm, may be NULL) and rotary;
     k, v into the mirror (and the paged pool); attention as duet_decode_attention_f32 (with its coded pages, in
     the pool, when poff is not NULL); x2 = x + attn Wo^T (+ bo);
     y = x2 + mlp(rmsnorm(x2) ln2), where mlp is E routed experts (top-k of softmax(h2 gate^T), renormalized when
     norm_topk; counts += picks) or, E = 0, one SwiGLU MLP (gate_up [2I, H], down [H, I]); panel: those weights
     in panels (duet_moe_silu_f32).
   Each stage is the standalone kernel above, so results equal the layer run stage by stage through them.
   fs: float scratch of duet_decode_layer_scratch(...) floats; is: int64 scratch of 4 max(E, 1) + 3 B k' (k' = k,
   or 1 when E = 0). */
int64_t duet_decode_layer_scratch(int64_t B, int64_t H, int64_t NH, int64_t KVH, int64_t D, int64_t lds, int64_t E,
                                  int64_t k, int64_t I) {
    const int64_t P = B * (E ? k : 1);
    return B * H * 4 + B * (NH + 2 * KVH) * D + B * NH * D + B * NH * lds + B * E + P +
           duet_moe_silu_scratch(B, H, I, E ? E : 1, E ? k : 1, INT64_MAX);
}

void duet_decode_layer_f32(const float *x, int64_t B, int64_t H, float eps, const float *ln1, const float *ln2,
                           const float *wqkv, const float *bqkv, int64_t NH, int64_t KVH, int64_t D,
                           const float *qk_norm, float scale, const float *cos_t, const float *sin_t, float *mirror_k,
                           float *mirror_v, const int64_t *slots, const int64_t *pos, int64_t cap, int64_t lds,
                           float *pool_k, float *pool_v, const int64_t *pool_slots, const float *wo, const float *bo,
                           int64_t E, int64_t k, int norm_topk, const float *gate, const float *gate_up,
                           const float *down, int64_t I, int panel, int64_t *counts, float *fs, int64_t *is, float *y,
                           int64_t page_floats, int64_t PG, const int64_t *poff, const int64_t *pblk,
                           const int64_t *pn) {
    const int64_t NQKV = (NH + 2 * KVH) * D;
    float *h = fs, *x2 = h + B * H, *h2 = x2 + B * H, *m = h2 + B * H, *qkv = m + B * H, *att = qkv + B * NQKV;
    float *sc = att + B * NH * D, *logits = sc + B * NH * lds, *wts = logits + B * E;
    float *moe_fs = wts + B * (E ? k : 1);
    duet_rms_norm_f32(x, B, H, ln1, 1, eps, h);
    duet_linear_f32(h, B, H, wqkv, NQKV, bqkv, qkv);
    norm_rope(qkv, B, NQKV, NH + KVH, D, qk_norm, eps, cos_t, sin_t);
    duet_decode_attention_f32(qkv, NQKV, qkv + NH * D, NQKV, qkv + (NH + KVH) * D, NQKV, mirror_k, mirror_v, slots,
                              pos, pool_k, pool_v, pool_slots, B, NH, KVH, D, cap, scale, sc, lds, att, pool_k, pool_v,
                              page_floats, PG, poff, pblk, pn);
    duet_linear_f32(att, B, NH * D, wo, H, bo, m);
    duet_add_rms_norm_f32(x, m, B, H, ln2, eps, x2, h2);
    if (E) {
        int64_t *ids = is, *iscratch = is + B * k;
        duet_moe_route_f32(h2, B, H, gate, E, k, norm_topk, logits, wts, ids, counts);
        duet_moe_silu_f32(h2, B, H, I, E, gate_up, down, ids, wts, k, INT64_MAX, panel, moe_fs, iscratch, m);
    } else {
        int64_t *ids = is;
        for (int64_t b = 0; b < B; b++) { ids[b] = 0; wts[b] = 1.f; }
        /* one expert of weight one: the same SwiGLU, with the weight multiply exact */
        duet_moe_silu_f32(h2, B, H, I, 1, gate_up, down, ids, wts, 1, INT64_MAX, panel, moe_fs, is + B, m);
    }
    const int64_t n = B * H;
    for (int64_t i = 0; i < n; i++) y[i] = x2[i] + m[i];
}
