/* Prefill attention on CPU, float32: one prompt chunk's queries over its keys, causal (a decoder's prompt) or full
   (an encoder's window), in the style of flash attention: the scores of a block of keys are computed, folded into a
   running softmax and multiplied into the output while they are in registers, so no [T, C] matrix is ever written.

   Why: torch's CPU flash-attention kernel ran a 256-token causal prompt (8 heads, head_dim 64) at a sixth of the
   core's multiply rate, much of it in small-GEMM calls and in the half of the score matrix causality masks out
   (0.85 ms a layer on an AMD EPYC, 2 threads; this kernel 0.31 ms), and a 4096-patch image frame (full attention,
   4 heads) at about half the rate reached here (a 1024 x 1024 image's vision tower 1.42 -> 0.96 s). Here:
   - keys are transposed once per call into kt [KVH][D][Cp] (Cp: C rounded up to AK, zero padded), so a vector of
     VW consecutive keys' scores is one multiply-add per dimension;
   - a task is RB query rows of one KV head (a row is a (query, head) pair: GQA heads that share a KV head share its
     key and value reads); it walks the key blocks its rows can see, and each block, while in L1, serves all its
     rows, AQ at a time;
   - per block of AK keys and AQ rows: AQ x AK scores in 4 * AQ vector sums, the running max and sum per row (a block
     a row cannot see at all leaves it unchanged), then the output rows, rescaled, += p @ V in 4 * AQ vector sums.
   Results equal torch's to float rounding (the same products, summed in another order). */
#include "cpu_kernels.h"

#define AQ 6             /* query rows a tile carries through a key block */
#define RB (8 * AQ)      /* query rows a task carries: each key block is read once for all of them */
#define AK (4 * VW)      /* keys per block: four vectors */
#define AD_MAX 256       /* the largest head_dim taken (the caller checks) */
#define ATT_PAR_MIN (1 << 20) /* multiply-adds below which one thread runs it all */

/* Scratch floats: the transposed keys, and for a head_dim that is not a multiple of VW the values padded to one. */
int64_t duet_prefill_attention_scratch(int64_t C, int64_t KVH, int64_t D) {
    const int64_t Cp = (C + AK - 1) / AK * AK, Dp = (D + VW - 1) / VW * VW;
    return KVH * D * Cp + (D % VW ? KVH * C * Dp : 0);
}

/* kt [KVH][D][Cp] from k [C, KVH, D] (rows ldk floats apart, heads skh); keys C..Cp-1 are zero. */
static void transpose_keys(const float *k, int64_t ldk, int64_t skh, int64_t C, int64_t KVH, int64_t D, int64_t Cp,
                           float *kt, int par) {
    const int64_t nc = Cp / VW, nd = D / VW;
#ifdef _OPENMP
#pragma omp parallel for schedule(static) if (par)
#endif
    for (int64_t t = 0; t < KVH * nc; t++) {
        const int64_t j = t / nc, c0 = (t % nc) * VW, rows = C - c0 < VW ? (C - c0 > 0 ? C - c0 : 0) : VW;
        for (int64_t d = 0; d < nd; d++)
            transpose_block(k + c0 * ldk + j * skh + d * VW, ldk, rows, kt + (j * D + d * VW) * Cp + c0, Cp, VW);
        for (int64_t d = nd * VW; d < D; d++) /* a head_dim that is not a multiple of VW: the last dimensions */
            for (int64_t c = c0; c < c0 + VW; c++) kt[(j * D + d) * Cp + c] = c < C ? k[c * ldk + j * skh + d] : 0.f;
    }
}

/* One task: rows qr[r] (r < n <= RB, D floats each) over keys 0..lim[r] of one KV head (ktj: its transposed keys,
   vj: its values, rows ldv apart and Dv >= D floats read of each, a multiple of VW: the values beyond D are zero),
   written normalized to orow[r] (D floats). Key block by key block, so each block's keys and
   values are read from memory once for all RB rows (a tile of AQ rows at a time, in L1). */
static void attend_rows(const float *const *qr, float *const *orow, const int64_t *lim, int n, const float *ktj,
                        int64_t Cp, const float *vj, int64_t ldv, int64_t D, int64_t Dv, float scale) {
    static __thread float o[RB][AD_MAX], p[AQ][AK];
    float m[RB], l[RB];
    int64_t kmax = 0;
    for (int r = 0; r < n; r++) {
        m[r] = -INFINITY;
        l[r] = 0.f;
        memset(o[r], 0, Dv * sizeof(float));
        if (lim[r] + 1 > kmax) kmax = lim[r] + 1;
    }
    const ivec iota = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
    for (int64_t kb = 0; kb < kmax; kb += AK) {
        for (int r0 = 0; r0 < n; r0 += AQ) {
            const int last = r0 + AQ <= n ? r0 + AQ - 1 : n - 1;
            int64_t tile_lim = lim[r0];
            for (int r = r0 + 1; r <= last; r++) tile_lim = lim[r] > tile_lim ? lim[r] : tile_lim;
            if (tile_lim < kb) continue; /* no row of this tile sees this block */
            const float *q4[AQ];
            int row[AQ];
            for (int a = 0; a < AQ; a++) {
                row[a] = r0 + a <= last ? r0 + a : last;
                q4[a] = qr[row[a]];
            }
            vec s[AQ][4];
            _Pragma("GCC unroll 8") for (int a = 0; a < AQ; a++)
                _Pragma("GCC unroll 4") for (int c = 0; c < 4; c++) s[a][c] = (vec){0};
            const float *kd = ktj + kb;
            for (int64_t d = 0; d < D; d++, kd += Cp) {
                const vec k0 = load(kd), k1 = load(kd + VW), k2 = load(kd + 2 * VW), k3 = load(kd + 3 * VW);
                _Pragma("GCC unroll 8") for (int a = 0; a < AQ; a++) {
                    const vec b = splat(q4[a][d]);
                    s[a][0] += b * k0;
                    s[a][1] += b * k1;
                    s[a][2] += b * k2;
                    s[a][3] += b * k3;
                }
            }
            float alpha[AQ];
            for (int a = 0; a < AQ; a++) {
                const int r = row[a];
                const int64_t see = lim[r] - kb; /* the last key of this block row r sees, relative to kb */
                if (see < 0 || (a > 0 && row[a] == row[a - 1])) { /* none (or a repeat): p zero, nothing rescaled */
                    alpha[a] = 1.f;
                    memset(p[a], 0, sizeof p[a]);
                    continue;
                }
                ivec ok[4];
                vec vmx = splat(m[r]);
                for (int c = 0; c < 4; c++) {
                    ok[c] = iota + (int)(c * VW) <= (ivec){0} + (int)(see < AK ? see : AK - 1);
                    s[a][c] = (vec)(((ivec)(s[a][c] * scale) & ok[c]) | ((ivec)((vec){0} - INFINITY) & ~ok[c]));
                    vmx = vmax(vmx, s[a][c]);
                }
                const float mx = hmax(vmx);
                alpha[a] = expf(m[r] - mx); /* 0 on the first block a row sees (m = -inf) */
                m[r] = mx;
                vec sum = (vec){0};
                for (int c = 0; c < 4; c++) {
                    const vec e = (vec)((ivec)vexp(s[a][c] - mx) & ok[c]);
                    sum += e;
                    memcpy(p[a] + c * VW, &e, sizeof e);
                }
                l[r] = l[r] * alpha[a] + hsum(sum);
            }
            const int64_t nk = tile_lim + 1 - kb < AK ? tile_lim + 1 - kb : AK;
            int64_t dc = 0;
            for (; dc + 4 * VW <= Dv; dc += 4 * VW) {
                vec acc[AQ][4];
                _Pragma("GCC unroll 8") for (int a = 0; a < AQ; a++) {
                    const vec al = splat(alpha[a]);
                    _Pragma("GCC unroll 4") for (int c = 0; c < 4; c++) acc[a][c] = load(o[row[a]] + dc + c * VW) * al;
                }
                const float *vr = vj + kb * ldv + dc;
                for (int64_t i = 0; i < nk; i++, vr += ldv) {
                    const vec v0 = load(vr), v1 = load(vr + VW), v2 = load(vr + 2 * VW), v3 = load(vr + 3 * VW);
                    _Pragma("GCC unroll 8") for (int a = 0; a < AQ; a++) {
                        const vec b = splat(p[a][i]);
                        acc[a][0] += b * v0;
                        acc[a][1] += b * v1;
                        acc[a][2] += b * v2;
                        acc[a][3] += b * v3;
                    }
                }
                for (int a = 0; a < AQ; a++) /* a repeated row's sums are its real row's before the block: dropped */
                    if (a == 0 || row[a] != row[a - 1])
                        _Pragma("GCC unroll 4") for (int c = 0; c < 4; c++)
                            memcpy(o[row[a]] + dc + c * VW, &acc[a][c], sizeof(vec));
            }
            for (; dc < Dv; dc += VW) { /* head_dim not a multiple of 64: one vector at a time */
                vec acc[AQ];
                for (int a = 0; a < AQ; a++) acc[a] = load(o[row[a]] + dc) * splat(alpha[a]);
                const float *vr = vj + kb * ldv + dc;
                for (int64_t i = 0; i < nk; i++, vr += ldv) {
                    const vec v0 = load(vr);
                    for (int a = 0; a < AQ; a++) acc[a] += splat(p[a][i]) * v0;
                }
                for (int a = 0; a < AQ; a++)
                    if (a == 0 || row[a] != row[a - 1]) memcpy(o[row[a]] + dc, &acc[a], sizeof(vec));
            }
        }
    }
    for (int r = 0; r < n; r++) {
        const vec inv = splat(1.f / l[r]);
        int64_t dc = 0;
        for (; dc + VW <= D; dc += VW) {
            const vec x = load(o[r] + dc) * inv;
            memcpy(orow[r] + dc, &x, sizeof x);
        }
        for (; dc < D; dc++) orow[r][dc] = o[r][dc] * inv[0];
    }
}

/* out [T, H, D] (rows ldo floats apart) = softmax(q k^T * scale) v for q [T, H, D] (rows ldq apart) over C keys and
   values k, v [C, KVH, D] (rows ldk / ldv apart, heads skh / svh); query head h reads KV head h / (H / KVH). Causal:
   query i sits at position C - T + i and sees keys 0..C - T + i (C >= T, the caller checks); else every query sees
   every key. D at most AD_MAX. kt: duet_prefill_attention_scratch(C, KVH, D) floats. With OpenMP the tasks are shared
   among the caller's threads when there is enough work. */
void duet_prefill_attention_f32(const float *q, int64_t ldq, const float *k, int64_t ldk, int64_t skh, const float *v,
                                int64_t ldv, int64_t svh, int64_t T, int64_t C, int64_t H, int64_t KVH, int64_t D,
                                float scale, int causal, float *kt, float *out, int64_t ldo) {
    const int64_t G = H / KVH, R = T * G, Cp = (C + AK - 1) / AK * AK, ntasks = (R + RB - 1) / RB;
    const int par = T * C * H * D / (causal ? 2 : 1) >= ATT_PAR_MIN;
    transpose_keys(k, ldk, skh, C, KVH, D, Cp, kt, par);
    const int64_t Dv = (D + VW - 1) / VW * VW;
    if (D != Dv) { /* the values padded to whole vectors, so the p @ V sums stay vectors */
        float *vp = kt + KVH * D * Cp;
        for (int64_t j = 0; j < KVH; j++)
            for (int64_t c = 0; c < C; c++) {
                float *row = vp + (j * C + c) * Dv;
                memcpy(row, v + c * ldv + j * svh, D * sizeof(float));
                memset(row + D, 0, (Dv - D) * sizeof(float));
            }
        v = vp, ldv = Dv, svh = C * Dv;
    }
#ifdef _OPENMP
#pragma omp parallel for schedule(dynamic, 1) if (par)
#endif
    for (int64_t t = 0; t < KVH * ntasks; t++) {
        /* the longest tasks (the last queries, which see the most keys) first */
        const int64_t j = t % KVH, r0 = (ntasks - 1 - t / KVH) * RB;
        const int n = R - r0 < RB ? (int)(R - r0) : RB;
        const float *qr[RB];
        float *orow[RB];
        int64_t lim[RB];
        for (int a = 0; a < n; a++) {
            const int64_t r = r0 + a, i = r / G, h = j * G + r % G;
            qr[a] = q + i * ldq + h * D;
            orow[a] = out + i * ldo + h * D;
            lim[a] = causal ? C - T + i : C - 1;
        }
        attend_rows(qr, orow, lim, n, kt + j * D * Cp, Cp, v + j * svh, ldv, D, Dv, scale);
    }
}
