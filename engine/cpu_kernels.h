/* The vector helpers the CPU kernels share (cpu_kernels.c, cpu_attention.c): a vec of VW floats (one cache
   line), loads, broadcasts, lane sums (one vector's, or sixteen at once), a 16 x 16 transpose and a vector exp.
   Header-only (static inline). */
#ifndef DUET_CPU_KERNELS_H
#define DUET_CPU_KERNELS_H
#include <stdint.h>
#include <string.h>
#include <math.h>
#ifdef _OPENMP
#include <omp.h>
#endif

#define VW 16 /* floats per vector: 64 bytes, one cache line */
#define NB 4  /* weight rows per block (BLOCK names four) */
typedef float vec __attribute__((vector_size(VW * sizeof(float))));

static inline vec load(const float *p) { vec v; memcpy(&v, p, sizeof v); return v; }

typedef int ivec __attribute__((vector_size(VW * sizeof(int))));

/* Every lane s. Spelled out so the compiler broadcasts from memory (a load); `(vec){0} + s` is an add (0 + -0 is not
   -0) and a broadcast from a register, which takes the shuffle port the multiplies use. */
static inline vec splat(float s) { return (vec){s, s, s, s, s, s, s, s, s, s, s, s, s, s, s, s}; }

/* The sum of a vector's lanes as a tree of four shuffle-adds (a chain of 16 scalar adds would cost more than the
   block's loads at few rows). */
static inline float hsum(vec v) {
    v += __builtin_shuffle(v, (ivec){8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7});
    v += __builtin_shuffle(v, (ivec){4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11});
    v += __builtin_shuffle(v, (ivec){2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13});
    v += __builtin_shuffle(v, (ivec){1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14});
    return v[0];
}

/* Two vectors of per-key partial sums (A's keys, then B's, each key's lanes in groups) folded into one with half
   the lanes per key: the lanes the masks pick from A and B are added pairwise. */
static inline vec fold(vec a, vec b, ivec p, ivec q) { return __builtin_shuffle(a, b, p) + __builtin_shuffle(a, b, q); }

/* Lane t = the lane sum of a[t], t < 16, by four rounds of fold (30 shuffles, where hsum per vector takes 64);
   a is overwritten. */
static inline vec fold16(vec *a) {
    const ivec p1 = {0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23};
    const ivec q1 = {8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31};
    const ivec p2 = {0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27};
    const ivec q2 = {4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31};
    const ivec p3 = {0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29};
    const ivec q3 = {2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22, 23, 26, 27, 30, 31};
    const ivec p4 = {0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30};
    const ivec q4 = {1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31};
    _Pragma("GCC unroll 8") for (int t = 0; t < 8; t++) a[t] = fold(a[2 * t], a[2 * t + 1], p1, q1);
    _Pragma("GCC unroll 4") for (int t = 0; t < 4; t++) a[t] = fold(a[2 * t], a[2 * t + 1], p2, q2);
    _Pragma("GCC unroll 2") for (int t = 0; t < 2; t++) a[t] = fold(a[2 * t], a[2 * t + 1], p3, q3);
    return fold(a[0], a[1], p4, q4);
}

/* The larger of a and b in each lane (b where either is NaN). */
static inline vec vmax(vec a, vec b) {
    const ivec m = a > b;
    return (vec)(((ivec)a & m) | ((ivec)b & ~m));
}

/* The largest lane, by the same four shuffle rounds as hsum. */
static inline float hmax(vec v) {
    v = vmax(v, __builtin_shuffle(v, (ivec){8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7}));
    v = vmax(v, __builtin_shuffle(v, (ivec){4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11}));
    v = vmax(v, __builtin_shuffle(v, (ivec){2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13}));
    v = vmax(v, __builtin_shuffle(v, (ivec){1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14}));
    return v[0];
}

/* dst[j * ldd + i] = src[i * lds + j] for i, j < VW: four rounds of pairing row i with row i + VW / 2 (lanes
   interleaved, low halves then high halves), each a rotation of the element's (row, column) index bits by one, so
   four rounds transpose. Rows at or beyond ``rows`` read as zeros, and only the first ``cols`` rows of dst are
   written. */
static inline void transpose_block(const float *src, int64_t lds, int64_t rows, float *dst, int64_t ldd, int64_t cols) {
    const ivec lo = {0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23};
    const ivec hi = {8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31};
    vec a[VW], b[VW];
    for (int i = 0; i < VW; i++) a[i] = i < rows ? load(src + i * lds) : (vec){0};
    for (int round = 0; round < 4; round++) {
        _Pragma("GCC unroll 8") for (int i = 0; i < VW / 2; i++) {
            b[2 * i] = __builtin_shuffle(a[i], a[i + VW / 2], lo);
            b[2 * i + 1] = __builtin_shuffle(a[i], a[i + VW / 2], hi);
        }
        memcpy(a, b, sizeof a);
    }
    for (int j = 0; j < cols; j++) memcpy(dst + j * ldd, &a[j], sizeof(vec));
}

static inline void prefetch(const float *p, int64_t n) {
    for (int64_t i = 0; i < n; i += VW) __builtin_prefetch(p + i, 0, 3);
}

/* exp(x) for each lane, float32, within 2 ulp of expf over [-87, 88] (inputs beyond are clamped; NaN stays NaN):
   x = n ln2 + r with |r| <= ln2 / 2, exp(r) by its degree-7 Taylor polynomial, times 2^n built in the exponent bits.
   A scalar expf per element cost a sixth of an expert's time at 32 rows. */
static inline vec vexp(vec x) {
    const vec hi = (vec){0} + 88.0f, lo = (vec){0} - 87.0f;
    ivec m = x > hi; /* lanes of -1 where true */
    x = (vec)(((ivec)x & ~m) | ((ivec)hi & m));
    m = x < lo;
    x = (vec)(((ivec)x & ~m) | ((ivec)lo & m));
    const vec magic = (vec){0} + 12582912.0f; /* 1.5 * 2^23: adding it rounds to an integer in the low bits */
    const vec t = x * 1.44269504f + magic;
    const vec n = t - magic;
    const ivec e = ((ivec)t - (ivec)magic + 127) << 23;
    const vec r = x - n * 0.693145752f - n * 1.42860677e-6f; /* ln2 in two parts: r exact to float rounding */
    vec p = (vec){0} + 1.f / 5040.f;
    p = p * r + 1.f / 720.f;
    p = p * r + 1.f / 120.f;
    p = p * r + 1.f / 24.f;
    p = p * r + 1.f / 6.f;
    p = p * r + 0.5f;
    p = p * r + 1.f;
    p = p * r + 1.f;
    return p * (vec)e;
}

/* Weights packed in panels (cpu_panels.c): PANEL output rows per panel, each stored k-major (K rows of the panel's
   width), so that a panel is one contiguous stream. N a multiple of VW. */
#define PANEL (4 * VW)
/* y [rows, N] (rows ldy apart) = x [rows, K] @ W^T for W [N, K] in panels at wp. */
void panel_gemv(const float *x, int64_t rows, int64_t K, const float *wp, int64_t N, float *y, int64_t ldy);

#endif
