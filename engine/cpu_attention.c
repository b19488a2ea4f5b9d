/* Prefill attention on CPU, float32: one prompt chunk's queries over its keys, causal (a decoder's prompt) or full
   (an encoder's window), in the style of flash attention: the scores of a block of keys are computed, folded into a
   running softmax and multiplied into the output while they are in registers, so no [T, C] matrix is ever written.

   Why: torch's CPU flash-attention kernel runs a 256-token causal prompt (8 heads, head_dim 64) at a sixth of the
   core's multiply rate, most of it in small-GEMM calls and in the half of the score matrix causality masks out
   (measured 0.85 ms a layer on an AMD EPYC, a quarter of a 256-token prefill's attention). Here:
   - keys are transposed once per call into kt [KVH][D][Cp] (Cp: C rounded up to AK, zero padded), so a vector of
     VW consecutive keys' scores is one multiply-add per dimension;
   - the work is split into tasks of AQ query rows of one KV head (a row is a (query, head) pair; GQA heads that
     share a KV head share its key and value reads), each carried through every key block it can see and no further;
   - per block of AK keys: AQ x AK scores in 16 vector sums, the running max and sum per row (a block a row cannot
     see at all leaves it unchanged), then the output rows, rescaled, += p @ V in AQ x 4 vector sums.
   Results equal torch's to float rounding (the same products, summed in another order). */
#include "cpu_kernels.h"

#define AQ 4             /* query rows a task carries */
#define AK (4 * VW)      /* keys per block: four vectors */
#define AD_MAX 512       /* the largest head_dim taken (the caller checks) */
#define ATT_PAR_MIN (1 << 20) /* multiply-adds below which one thread runs it all */

int64_t duet_prefill_attention_scratch(int64_t C, int64_t KVH, int64_t D) {
    return KVH * D * ((C + AK - 1) / AK * AK);
}

/* kt [KVH][D][Cp] from k [C, KVH, D] (rows ldk floats apart); keys C..Cp-1 are zero. */
static void transpose_keys(const float *k, int64_t ldk, int64_t C, int64_t KVH, int64_t D, int64_t Cp, float *kt,
                           int par) {
    const int64_t nc = Cp / VW, nd = D / VW;
#ifdef _OPENMP
#pragma omp parallel for schedule(static) if (par)
#endif
    for (int64_t t = 0; t < KVH * nc; t++) {
        const int64_t j = t / nc, c0 = (t % nc) * VW, rows = C - c0 < VW ? (C - c0 > 0 ? C - c0 : 0) : VW;
        for (int64_t d = 0; d < nd; d++)
            transpose_block(k + c0 * ldk + j * D + d * VW, ldk, rows, kt + (j * D + d * VW) * Cp + c0, Cp, VW);
    }
}

/* One task: rows qr[a] (a < AQ, D floats each) over keys 0..lim[a] of one KV head (ktj: its transposed keys, vj: its
   values, rows ldv apart), written normalized to orow[a]; n: the rows that are real (the rest repeat the last). */
static void attend_rows(const float *const *qr, float *const *orow, const int64_t *lim, int n, const float *ktj,
                        int64_t Cp, const float *vj, int64_t ldv, int64_t D, float scale) {
    float o[AQ][AD_MAX], p[AQ][AK], m[AQ], l[AQ], alpha[AQ];
    int64_t kmax = 0;
    for (int a = 0; a < AQ; a++) {
        m[a] = -INFINITY;
        l[a] = 0.f;
        memset(o[a], 0, D * sizeof(float));
        if (lim[a] + 1 > kmax) kmax = lim[a] + 1;
    }
    const ivec iota = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
    for (int64_t kb = 0; kb < kmax; kb += AK) {
        vec s[AQ][4];
        _Pragma("GCC unroll 4") for (int a = 0; a < AQ; a++)
            _Pragma("GCC unroll 4") for (int c = 0; c < 4; c++) s[a][c] = (vec){0};
        const float *kd = ktj + kb;
        for (int64_t d = 0; d < D; d++, kd += Cp) {
            const vec k0 = load(kd), k1 = load(kd + VW), k2 = load(kd + 2 * VW), k3 = load(kd + 3 * VW);
            _Pragma("GCC unroll 4") for (int a = 0; a < AQ; a++) {
                const vec b = splat(qr[a][d]);
                s[a][0] += b * k0;
                s[a][1] += b * k1;
                s[a][2] += b * k2;
                s[a][3] += b * k3;
            }
        }
        for (int a = 0; a < AQ; a++) {
            const int64_t see = lim[a] - kb; /* the last key of this block row a sees, relative to kb */
            if (see < 0) { /* none: p stays zero and nothing is rescaled */
                alpha[a] = 1.f;
                memset(p[a], 0, sizeof p[a]);
                continue;
            }
            ivec ok[4];
            vec vmx = splat(m[a]);
            for (int c = 0; c < 4; c++) {
                ok[c] = iota + (int)(c * VW) <= (ivec){0} + (int)(see < AK ? see : AK - 1);
                s[a][c] = (vec)(((ivec)(s[a][c] * scale) & ok[c]) | ((ivec)((vec){0} - INFINITY) & ~ok[c]));
                vmx = vmax(vmx, s[a][c]);
            }
            const float mx = hmax(vmx);
            alpha[a] = expf(m[a] - mx); /* 0 on the first block a row sees (m = -inf) */
            m[a] = mx;
            vec sum = (vec){0};
            for (int c = 0; c < 4; c++) {
                const vec e = (vec)((ivec)vexp(s[a][c] - mx) & ok[c]);
                sum += e;
                memcpy(p[a] + c * VW, &e, sizeof e);
            }
            l[a] = l[a] * alpha[a] + hsum(sum);
        }
        const int64_t nk = kmax - kb < AK ? kmax - kb : AK;
        int64_t dc = 0;
        for (; dc + 4 * VW <= D; dc += 4 * VW) {
            vec acc[AQ][4];
            _Pragma("GCC unroll 4") for (int a = 0; a < AQ; a++) {
                const vec al = splat(alpha[a]);
                _Pragma("GCC unroll 4") for (int c = 0; c < 4; c++) acc[a][c] = load(o[a] + dc + c * VW) * al;
            }
            const float *vr = vj + kb * ldv + dc;
            for (int64_t i = 0; i < nk; i++, vr += ldv) {
                const vec v0 = load(vr), v1 = load(vr + VW), v2 = load(vr + 2 * VW), v3 = load(vr + 3 * VW);
                _Pragma("GCC unroll 4") for (int a = 0; a < AQ; a++) {
                    const vec b = splat(p[a][i]);
                    acc[a][0] += b * v0;
                    acc[a][1] += b * v1;
                    acc[a][2] += b * v2;
                    acc[a][3] += b * v3;
                }
            }
            _Pragma("GCC unroll 4") for (int a = 0; a < AQ; a++)
                _Pragma("GCC unroll 4") for (int c = 0; c < 4; c++) memcpy(o[a] + dc + c * VW, &acc[a][c], sizeof(vec));
        }
        for (; dc < D; dc += VW) { /* head_dim not a multiple of 64: one vector at a time */
            vec acc[AQ];
            for (int a = 0; a < AQ; a++) acc[a] = load(o[a] + dc) * splat(alpha[a]);
            const float *vr = vj + kb * ldv + dc;
            for (int64_t i = 0; i < nk; i++, vr += ldv) {
                const vec v0 = load(vr);
                for (int a = 0; a < AQ; a++) acc[a] += splat(p[a][i]) * v0;
            }
            for (int a = 0; a < AQ; a++) memcpy(o[a] + dc, &acc[a], sizeof(vec));
        }
    }
    for (int a = 0; a < n; a++) {
        const vec inv = splat(1.f / l[a]);
        for (int64_t dc = 0; dc < D; dc += VW) {
            const vec r = load(o[a] + dc) * inv;
            memcpy(orow[a] + dc, &r, sizeof r);
        }
    }
}

/* out [T, H, D] (rows ldo floats apart) = softmax(q k^T * scale) v for q [T, H, D] (rows ldq apart) over C keys and
   values k, v [C, KVH, D] (rows ldk / ldv apart); query head h reads KV head h / (H / KVH). Causal: query i sits at
   position C - T + i and sees keys 0..C - T + i (C >= T, the caller checks); else every query sees every key. D a
   multiple of VW, at most AD_MAX. kt: duet_prefill_attention_scratch(C, KVH, D) floats. With OpenMP the tasks are
   shared among the caller's threads when there is enough work. */
void duet_prefill_attention_f32(const float *q, int64_t ldq, const float *k, int64_t ldk, const float *v, int64_t ldv,
                                int64_t T, int64_t C, int64_t H, int64_t KVH, int64_t D, float scale, int causal,
                                float *kt, float *out, int64_t ldo) {
    const int64_t G = H / KVH, R = T * G, Cp = (C + AK - 1) / AK * AK, ntiles = (R + AQ - 1) / AQ;
    const int par = T * C * H * D / (causal ? 2 : 1) >= ATT_PAR_MIN;
    transpose_keys(k, ldk, C, KVH, D, Cp, kt, par);
#ifdef _OPENMP
#pragma omp parallel for schedule(dynamic, 2) if (par)
#endif
    for (int64_t t = 0; t < KVH * ntiles; t++) {
        /* the longest tasks (the last queries, which see the most keys) first */
        const int64_t j = t % KVH, r0 = (ntiles - 1 - t / KVH) * AQ;
        const int n = R - r0 < AQ ? (int)(R - r0) : AQ;
        const float *qr[AQ];
        float *orow[AQ];
        int64_t lim[AQ];
        for (int a = 0; a < AQ; a++) {
            const int64_t r = r0 + (a < n ? a : n - 1), i = r / G, h = j * G + r % G;
            qr[a] = q + i * ldq + h * D;
            orow[a] = out + i * ldo + h * D;
            lim[a] = causal ? C - T + i : C - 1;
        }
        attend_rows(qr, orow, lim, n, kt + j * D * Cp, Cp, v + j * D, ldv, D, scale);
    }
}
