// Fused decode-path operations the model would otherwise spend several PyTorch ops (and their dispatch) on:
// attention over the slot-major KV cache, residual add + RMSNorm, SiLU(gate) * up. Float32, x86-64 AVX2 + FMA.
// Every result is computed per row in a fixed order, independent of how many rows are in the call.
#include <immintrin.h>
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include "kernels.h"
#include <stdlib.h>

// Row-wise ops (norm, RoPE, KV write) start a parallel region from this many rows (prompts); decode steps' few
// rows are cheaper than the region's wake-up.
#define ROWS_PER_REGION 32

static inline float hsum8(__m256 v) {
    const __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    const __m128 t = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(t, _mm_movehdup_ps(t)));
}

static inline float dot(const float *a, const float *b, int64_t n) {  // n % 8 == 0
    __m256 acc = _mm256_setzero_ps();
    for (int64_t i = 0; i < n; i += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc);
    return hsum8(acc);
}

// exp(x) for 8 lanes (Cephes' expf polynomial, ~1 ulp); below about -87.3 it returns 0, so exp(-inf) == 0.
static inline __m256 exp8(__m256 x) {
    x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-88.3762626647949f)), _mm256_set1_ps(88.3762626647949f));
    __m256 fx = _mm256_floor_ps(_mm256_fmadd_ps(x, _mm256_set1_ps(1.44269504088896341f), _mm256_set1_ps(0.5f)));
    fx = _mm256_min_ps(_mm256_max_ps(fx, _mm256_set1_ps(-127.0f)), _mm256_set1_ps(127.0f));
    x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(0.693359375f), x);
    x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(-2.12194440e-4f), x);
    __m256 y = _mm256_set1_ps(1.9875691500E-4f);
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.3981999507E-3f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(8.3334519073E-3f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(4.1665795894E-2f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.6666665459E-1f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(5.0000001201E-1f));
    y = _mm256_fmadd_ps(y, _mm256_mul_ps(x, x), _mm256_add_ps(x, _mm256_set1_ps(1.0f)));
    const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(fx), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(y, _mm256_castsi256_ps(e));
}

// Dot products of N query heads (head h at q + h * qh) with 4 key rows at once: 4 N independent FMA chains, each
// key vector loaded once for all N heads (one chain per head and key: the FMA unit's latency is hidden, where one
// head's 4 chains alone would wait on it). Each key's chain runs over d in order and is reduced in the same order
// (fold to 8 lanes, then the hadd tree) whatever N and whichever of the 4 slots it is in, so a score never depends
// on which keys or heads it was computed with. The AVX-512 build uses 16-lane chains when D % 16 == 0 (fixed per
// model, so still one order per build). out[h]: head h's 4 scores.
static inline __m128 reduce4(__m256 a0, __m256 a1, __m256 a2, __m256 a3) {
    const __m256 s = _mm256_hadd_ps(_mm256_hadd_ps(a0, a1), _mm256_hadd_ps(a2, a3));
    return _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1));
}

#define DOT_PASS(NAME, VEC, VL, ZERO, LOAD, FMA, FOLD)                                                         \
    static inline __attribute__((always_inline)) void NAME(const int N, const float *q, int64_t qh,          \
                                                           const float *k0, const float *k1, const float *k2, \
                                                           const float *k3, int64_t D, __m128 *out) {         \
        VEC a[DOT_HEADS][4];                                                                                   \
        for (int h = 0; h < N; h++)                                                                            \
            for (int j = 0; j < 4; j++) a[h][j] = ZERO();                                                      \
        for (int64_t d = 0; d < D; d += VL) {                                                                  \
            const VEC c0 = LOAD(k0 + d), c1 = LOAD(k1 + d), c2 = LOAD(k2 + d), c3 = LOAD(k3 + d);             \
            for (int h = 0; h < N; h++) {                                                                      \
                const VEC qv = LOAD(q + h * qh + d);                                                           \
                a[h][0] = FMA(qv, c0, a[h][0]);                                                                \
                a[h][1] = FMA(qv, c1, a[h][1]);                                                                \
                a[h][2] = FMA(qv, c2, a[h][2]);                                                                \
                a[h][3] = FMA(qv, c3, a[h][3]);                                                                \
            }                                                                                                  \
        }                                                                                                      \
        for (int h = 0; h < N; h++) out[h] = reduce4(FOLD(a[h][0]), FOLD(a[h][1]), FOLD(a[h][2]), FOLD(a[h][3])); \
    }

#define FOLD8(a) (a)
#if defined(__AVX512F__)
// heads per pass: 4 N accumulators and the 4 key vectors in 32 registers
#define DOT_HEADS 6
#define FOLD16(b) _mm256_add_ps(_mm512_castps512_ps256(b), _mm512_extractf32x8_ps(b, 1))
DOT_PASS(dot_pass16, __m512, 16, _mm512_setzero_ps, _mm512_loadu_ps, _mm512_fmadd_ps, FOLD16)
#else
// in 16 registers: 12 accumulators and a query vector (GCC takes the key vectors as memory operands)
#define DOT_HEADS 3
#endif
DOT_PASS(dot_pass8, __m256, 8, _mm256_setzero_ps, _mm256_loadu_ps, _mm256_fmadd_ps, FOLD8)

static inline __attribute__((always_inline)) void dot_pass(const int N, const float *q, int64_t qh,
                                                           const float *k0, const float *k1, const float *k2,
                                                           const float *k3, int64_t D, __m128 *out) {
#if defined(__AVX512F__)
    if (D % 16 == 0) {
        dot_pass16(N, q, qh, k0, k1, k2, k3, D, out);
        return;
    }
#endif
    dot_pass8(N, q, qh, k0, k1, k2, k3, D, out);
}

// dot_pass over G heads (G a constant at each call, at most WS_MAX_HEADS): passes of DOT_HEADS, then the rest.
static inline __attribute__((always_inline)) void dot_heads(const int G, const float *q, int64_t qh,
                                                            const float *k0, const float *k1, const float *k2,
                                                            const float *k3, int64_t D, __m128 *out) {
    int h = 0;
    for (; h + DOT_HEADS <= G; h += DOT_HEADS) dot_pass(DOT_HEADS, q + h * qh, qh, k0, k1, k2, k3, D, out + h);
    if (G - h == 1) dot_pass(1, q + h * qh, qh, k0, k1, k2, k3, D, out + h);
#if DOT_HEADS > 2
    else if (G - h == 2) dot_pass(2, q + h * qh, qh, k0, k1, k2, k3, D, out + h);
    else if (G - h == 3) dot_pass(3, q + h * qh, qh, k0, k1, k2, k3, D, out + h);
    else if (G - h == 4) dot_pass(4, q + h * qh, qh, k0, k1, k2, k3, D, out + h);
    else if (G - h == 5) dot_pass(5, q + h * qh, qh, k0, k1, k2, k3, D, out + h);
#endif
}

// Where key row t of one sequence and KV head lies: a contiguous cache view (blocks NULL: k + t * kt), or a paged
// cache whose block table row `blocks` maps position t to block blocks[t >> shift], row t & mask of that block
// (bstride floats apart). The value row is voff floats after its key row (V heads follow K heads in the cache).
typedef struct KVRows {
    const float *k;
    const int64_t *blocks;
    int64_t shift, mask, bstride, kt, voff;
} KVRows;

static inline __attribute__((always_inline)) const float *key_row(const KVRows *r, int64_t t) {
    return r->blocks ? r->k + r->blocks[t >> r->shift] * r->bstride + (t & r->mask) * r->kt : r->k + t * r->kt;
}

// o_h[0, D) = sum_t p_h[t] * v[t] for G heads h that share the value rows (one GQA group): each v row is loaded
// once for all G heads. Up to 8 x VL output floats per head in registers at a time; a key whose weight is zero for
// every head is skipped (a zero weight among others adds exactly +-0: the same sums). Every output element is one
// FMA chain over t in order, whatever G is, so a head's result never depends on the others.
#if defined(__AVX512F__)
#define WS_VEC __m512
#define WS_VL 16
#define WS_REGS 28
#define WS_ZERO _mm512_setzero_ps
#define WS_SET1 _mm512_set1_ps
#define WS_FMA _mm512_fmadd_ps
#define WS_LOAD _mm512_loadu_ps
#define WS_STORE _mm512_storeu_ps
#else
#define WS_VEC __m256
#define WS_VL 8
#define WS_REGS 14
#define WS_ZERO _mm256_setzero_ps
#define WS_SET1 _mm256_set1_ps
#define WS_FMA _mm256_fmadd_ps
#define WS_LOAD _mm256_loadu_ps
#define WS_STORE _mm256_storeu_ps
#endif
#define WS_MAX_HEADS 6

// R vectors of output for G heads (G, R constants at each call): p [G rows, pstride apart], head h's output at o[h];
// live: bit t set where some head's weight at t is not zero.
static inline __attribute__((always_inline)) void ws_tile(const int G, const int R, const float *p, int64_t pstride,
                                                          const uint8_t *live, const KVRows *kv, int64_t T,
                                                          float *const *o, int64_t d0) {
    WS_VEC acc[WS_MAX_HEADS][8];
    for (int h = 0; h < G; h++)
        for (int j = 0; j < R; j++) acc[h][j] = WS_ZERO();
    for (int64_t t = 0; t < T; t++) {
        if (!(live[t >> 3] >> (t & 7) & 1)) continue;
        const float *vt = key_row(kv, t) + kv->voff + d0;
        WS_VEC vv[8];
        for (int j = 0; j < R; j++) vv[j] = WS_LOAD(vt + WS_VL * j);
        for (int h = 0; h < G; h++) {
            const WS_VEC w = WS_SET1(p[h * pstride + t]);
            for (int j = 0; j < R; j++) acc[h][j] = WS_FMA(w, vv[j], acc[h][j]);
        }
    }
    for (int h = 0; h < G; h++)
        for (int j = 0; j < R; j++) WS_STORE(o[h] + d0 + WS_VL * j, acc[h][j]);
}

// The widest register tiles that fit (G heads x R vectors + R value vectors <= WS_REGS), then narrower ones.
static inline __attribute__((always_inline)) void ws_heads(const int G, const float *p, int64_t pstride,
                                                           const uint8_t *live, const KVRows *kv, int64_t T,
                                                           int64_t D, float *const *o) {
    int64_t d0 = 0;
    if ((G + 1) * 8 <= WS_REGS)
        for (; d0 + 8 * WS_VL <= D; d0 += 8 * WS_VL) ws_tile(G, 8, p, pstride, live, kv, T, o, d0);
    if ((G + 1) * 4 <= WS_REGS)
        for (; d0 + 4 * WS_VL <= D; d0 += 4 * WS_VL) ws_tile(G, 4, p, pstride, live, kv, T, o, d0);
    for (; d0 + 2 * WS_VL <= D; d0 += 2 * WS_VL) ws_tile(G, 2, p, pstride, live, kv, T, o, d0);
    for (; d0 + WS_VL <= D; d0 += WS_VL) ws_tile(G, 1, p, pstride, live, kv, T, o, d0);
    for (; d0 < D; d0 += 8)  // AVX-512 build with D % 16 == 8
        for (int h = 0; h < G; h++) {
            __m256 acc = _mm256_setzero_ps();
            for (int64_t t = 0; t < T; t++)
                if (p[h * pstride + t] != 0.0f)
                    acc = _mm256_fmadd_ps(_mm256_set1_ps(p[h * pstride + t]), _mm256_loadu_ps(key_row(kv, t) + kv->voff + d0), acc);
            _mm256_storeu_ps(o[h] + d0, acc);
        }
}

// live[t / 8] bit t % 8: whether any of the n weight rows (pstride apart, readable up to T rounded up to 8) is not
// zero at t < T. Computed once per pass, 8 keys at a time, instead of per key in every tile.
static void live_keys(int64_t n, const float *p, int64_t pstride, int64_t T, uint8_t *live) {
    for (int64_t t = 0; t < T; t += 8) {
        int m = 0;
        for (int64_t h = 0; h < n; h++)
            m |= _mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(p + h * pstride + t), _mm256_setzero_ps(), _CMP_NEQ_UQ));
        live[t >> 3] = (uint8_t)(T - t < 8 ? m & ((1 << (T - t)) - 1) : m);
    }
}

// ws_heads for any number of heads (n, weights p [n rows, pstride apart], outputs o [n]): passes of up to
// WS_MAX_HEADS, each reading the value rows once for all its heads. live: (T + 7) / 8 bytes of scratch.
static __attribute__((noinline)) void weighted_sums(int64_t n, const float *p, int64_t pstride, const KVRows *kv,
                                                    int64_t T, int64_t D, float *const *o,
                                                    uint8_t *live) {
    for (int64_t h0 = 0; h0 < n; h0 += WS_MAX_HEADS) {
        const float *ph = p + h0 * pstride;
        float *const *oh = o + h0;
        const int64_t g = n - h0 < WS_MAX_HEADS ? n - h0 : WS_MAX_HEADS;
        live_keys(g, ph, pstride, T, live);
        switch (g) {
            case 1: ws_heads(1, ph, pstride, live, kv, T, D, oh); break;
            case 2: ws_heads(2, ph, pstride, live, kv, T, D, oh); break;
            case 3: ws_heads(3, ph, pstride, live, kv, T, D, oh); break;
            case 4: ws_heads(4, ph, pstride, live, kv, T, D, oh); break;
            case 5: ws_heads(5, ph, pstride, live, kv, T, D, oh); break;
            default: ws_heads(6, ph, pstride, live, kv, T, D, oh); break;
        }
    }
}

// Scores of R query rows x G query heads (row r's head h at q + r * qq + h * qh) against keys [0, T) (kv's rows):
// p[r * prs + h * pstride + t] = q . k_t * scale, softcapped, -inf where row r's mask (mrow + r * mq, if any) masks t.
// Keys go 4 at a time, each 4-key group loaded once for every row and head (G a constant at each call: a row's G x 4
// dot products interleave in dot_heads). Each score is reduced alike whatever G and R: bitwise the same as one row
// and head at a time.
// tend[r]: the end of row r's last 4-key group with an unmasked key (0 if none); every p row is written up to T
// rounded up to 4 (pstride >= T rounded up to 8).
// The value rows (kv->voff after their keys), fetched into the cache as their keys are read, so the weighted
// sums that follow do not wait on memory (in decode steps the cache rows come from DRAM).
static inline __attribute__((always_inline)) void scores(const int G, int64_t R, const float *q, int64_t qh,
                                                         int64_t qq, const KVRows *kv, int64_t T, int64_t D,
                                                         const uint8_t *mrow, int64_t mq,
                                                         float scale, float softcap, float *p, int64_t pstride,
                                                         int64_t prs, int64_t *tend) {
    const __m128 vscale = _mm_set1_ps(scale), ninf = _mm_set1_ps(-INFINITY);
    for (int64_t r = 0; r < R; r++) tend[r] = 0;
    for (int64_t t = 0; t < T; t += 4) {
        const int64_t t1 = t + 1 < T ? t + 1 : t, t2 = t + 2 < T ? t + 2 : t, t3 = t + 3 < T ? t + 3 : t;
        const int64_t te = t + 4 < T ? t + 4 : T;
        int fetched = 0;
        for (int64_t r = 0; r < R; r++) {
            float *pr = p + r * prs;
            __m128 keep = _mm_castsi128_ps(_mm_set1_epi32(-1));
            if (mrow) {
                const uint8_t *mr = mrow + r * mq;
                // the 4 mask bytes in one load (bools are 0 or 1): all kept, all masked, or a mix
                uint32_t m4;
                if (t + 4 <= T)
                    __builtin_memcpy(&m4, mr + t, 4);
                else
                    m4 = mr[t] | mr[t1] << 8 | mr[t2] << 16 | (uint32_t)mr[t3] << 24;
                if (m4 == 0) {
                    for (int h = 0; h < G; h++) _mm_storeu_ps(pr + h * pstride + t, ninf);
                    continue;
                }
                if (m4 != 0x01010101u) {
                    const __m128i m = _mm_cvtepu8_epi32(_mm_cvtsi32_si128((int)m4));
                    keep = _mm_castsi128_ps(_mm_xor_si128(_mm_cmpeq_epi32(m, _mm_setzero_si128()), _mm_set1_epi32(-1)));
                }
            }
            tend[r] = te;
            if (!fetched) {
                for (int64_t u = t; u < te; u++)
                    for (int64_t l = 0; l < D; l += 16)
                        _mm_prefetch((const char *)(key_row(kv, u) + kv->voff + l), _MM_HINT_T0);
                fetched = 1;
            }
            __m128 sc[WS_MAX_HEADS];
            dot_heads(G, q + r * qq, qh, key_row(kv, t), key_row(kv, t1), key_row(kv, t2), key_row(kv, t3), D, sc);
            for (int h = 0; h < G; h++) {
                sc[h] = _mm_mul_ps(sc[h], vscale);
                if (softcap > 0) {
                    float x[4];
                    _mm_storeu_ps(x, sc[h]);
                    for (int j = 0; j < 4; j++) x[j] = tanhf(x[j] / softcap) * softcap;
                    sc[h] = _mm_loadu_ps(x);
                }
                _mm_storeu_ps(pr + h * pstride + t, _mm_blendv_ps(ninf, sc[h], keep));
            }
        }
    }
}

// In place on p [0, tend rounded up to 8): the softmax numerators exp(x - max), zero where x is -inf (everything
// zero when nothing is attended to). Returns 1 / their sum (0 when nothing is attended to). 8-lane sums over t.
static inline __attribute__((always_inline)) float softmax_numerators(float *p, int64_t tend) {
    const int64_t tend8 = (tend + 7) / 8 * 8;
    for (int64_t t = tend; t < tend8; t++) p[t] = -INFINITY;
    __m256 vmx = _mm256_set1_ps(-INFINITY);
    for (int64_t t = 0; t < tend8; t += 8) vmx = _mm256_max_ps(vmx, _mm256_load_ps(p + t));
    float mx = -INFINITY;
    float lanes[8];
    _mm256_storeu_ps(lanes, vmx);
    for (int j = 0; j < 8; j++) mx = lanes[j] > mx ? lanes[j] : mx;
    if (mx == -INFINITY) {
        for (int64_t t = 0; t < tend8; t++) p[t] = 0.0f;
        return 0.0f;
    }
    const __m256 vm = _mm256_set1_ps(mx), ninf = _mm256_set1_ps(-INFINITY);
    __m256 vs = _mm256_setzero_ps();
    for (int64_t t = 0; t < tend8; t += 8) {
        const __m256 x = _mm256_load_ps(p + t);
        const __m256 e = _mm256_andnot_ps(_mm256_cmp_ps(x, ninf, _CMP_EQ_OQ), exp8(_mm256_sub_ps(x, vm)));
        _mm256_store_ps(p + t, e);
        vs = _mm256_add_ps(vs, e);
    }
    return 1.0f / hsum8(vs);
}

// scores for any group size G: G a constant for G <= 6; larger groups one head at a time (the mask, hence the ends,
// are the same for every head). p [R, G, T8].
static inline __attribute__((always_inline)) void any_scores(int64_t G, int64_t R, const float *q, int64_t qh,
                                                             int64_t qq, const KVRows *kv, int64_t T, int64_t D,
                                                             const uint8_t *mrow, int64_t mq,
                                                             float scale, float softcap, float *p, int64_t T8,
                                                             int64_t *tend) {
    if (G == 1)
        scores(1, R, q, qh, qq, kv, T, D, mrow, mq, scale, softcap, p, T8, T8, tend);
    else if (G == 2)
        scores(2, R, q, qh, qq, kv, T, D, mrow, mq, scale, softcap, p, T8, 2 * T8, tend);
    else if (G == 3)
        scores(3, R, q, qh, qq, kv, T, D, mrow, mq, scale, softcap, p, T8, 3 * T8, tend);
    else if (G == 4)
        scores(4, R, q, qh, qq, kv, T, D, mrow, mq, scale, softcap, p, T8, 4 * T8, tend);
    else if (G == 5)
        scores(5, R, q, qh, qq, kv, T, D, mrow, mq, scale, softcap, p, T8, 5 * T8, tend);
    else if (G == 6)
        scores(6, R, q, qh, qq, kv, T, D, mrow, mq, scale, softcap, p, T8, 6 * T8, tend);
    else
        for (int64_t h = 0; h < G; h++)
            scores(1, R, q + h * qh, qh, qq, kv, T, D, mrow, mq, scale, softcap, p + h * T8, T8, G * T8,
                   tend);
}

// Query rows of one sequence and head group taken together (up to this many): each key and value row is read once
// for all of them.
#define ATT_ROWS 8

// q: [S, Hq, Q, D] with strides (qs, qh, qq) in elements, D contiguous; k, v: [S, Hkv, T, D] with strides
// (ks, kh, kt) (the cache view; v shares k's strides), or, with a block table, the paged cache's K and V heads
// [num_blocks, Hkv, 1 << bshift, D] with strides (ks, kh, kt), sequence s's position t in block
// blocks[s * nbt + (t >> bshift)]; mask: [S, 1, Q, T] bool with strides (ms, mq), T contiguous,
// or NULL (attend to all T). out: [S, Q, Hq, D] contiguous (the layout o_proj reads). D % 8 == 0.
// softcap > 0 applies tanh(score / softcap) * softcap before the mask (Gemma 2 style).
// qlen [S]: sequence s has rows 0 .. qlen[s] - 1, the rest padding (not computed, out left as it was); NULL: Q each.
// Batch invariance: a row's scores, softmax (8-lane sums over t, padded with exact zeros) and weighted sum depend
// only on that row's q, keys and mask, never on S, T, the other rows or how the rows are grouped.
void attention_f32(const float *q, int64_t S, int64_t Hq, int64_t Q, int64_t D, int64_t qs, int64_t qh, int64_t qq,
                   const float *k, const float *v, int64_t Hkv, int64_t T, int64_t ks, int64_t kh, int64_t kt,
                   const int64_t *blocks, int64_t nbt, int64_t bshift, const uint8_t *mask, int64_t ms, int64_t mq,
                   float scale, float softcap, float *out, const int64_t *qlen, int nthreads) {
    // first[s]: the number of rows before sequence s (first[S]: all of them)
    int64_t *first = malloc(sizeof(int64_t) * (S + 1));
    first[0] = 0;
    for (int64_t s = 0; s < S; s++) first[s + 1] = first[s] + (qlen ? qlen[s] : Q);
    const int64_t rows = first[S];
    // one work item = one query row of one KV group: its G query heads read every key and value row once; too few
    // such items to keep the threads busy (batch 1 decode): one item per head
    const int64_t group = Hq / Hkv, T8 = (T + 7) / 8 * 8 > 0 ? (T + 7) / 8 * 8 : 8;
    const int threads = rows * Hq * T * D >= (1 << 17) ? nthreads : 1;  // small problems: no thread wake-up
    const int64_t G = rows * Hkv >= 2 * threads ? group : 1, work = rows * (Hq / G);
#pragma omp parallel num_threads(threads)
    {
        // a contiguous share of the items (sequence, then head group, then row; the split of schedule(static)), in
        // which consecutive rows of one sequence and head group go together
        const int64_t nt = omp_get_num_threads(), chunk = (work + nt - 1) / nt;
        const int64_t i0 = chunk * omp_get_thread_num(), i1 = i0 + chunk < work ? i0 + chunk : work;
        float *p = aligned_alloc(32, sizeof(float) * ATT_ROWS * G * T8);  // [R, G, T8] scores, then weights
        float *inv = malloc(sizeof(float) * ATT_ROWS * G);
        float **o = malloc(sizeof(float *) * ATT_ROWS * G);
        uint8_t *live = malloc(T8 / 8);
        int64_t tend[ATT_ROWS];
        int64_t s = 0;
        for (int64_t i = i0, R; i < i1; i += R) {
            // the sequence of item i: items only move forward
            while (first[s + 1] * (Hq / G) <= i) s++;
            const int64_t n = first[s + 1] - first[s], j = i - first[s] * (Hq / G);
            const int64_t h0 = j / n * G, t0 = j % n, g = h0 / group;
            R = n - t0 < i1 - i ? n - t0 : i1 - i;
            R = R < ATT_ROWS ? R : ATT_ROWS;
            const KVRows kr = {blocks ? k + g * kh : k + s * ks + g * kh, blocks ? blocks + s * nbt : NULL, bshift,
                               ((int64_t)1 << bshift) - 1, ks, kt, v - k};
            const KVRows *kv = &kr;
            const uint8_t *mrow = mask ? mask + s * ms + t0 * mq : NULL;
            const float *qv = q + s * qs + h0 * qh + t0 * qq;
            // one row (decode): R a constant, the row loop compiled away
            if (R == 1)
                any_scores(G, 1, qv, qh, qq, kv, T, D, mrow, mq, scale, softcap, p, T8, tend);
            else
                any_scores(G, R, qv, qh, qq, kv, T, D, mrow, mq, scale, softcap, p, T8, tend);
            // keys past a row's last 4-key group with an unmasked key are all masked (causal prefill): the weighted
            // sums run to the rows' furthest end, the other rows' weights zero beyond their own
            int64_t tw = 0;
            for (int64_t r = 0; r < R; r++) tw = tend[r] > tw ? tend[r] : tw;
            for (int64_t r = 0; r < R; r++)
                for (int64_t h = 0; h < G; h++) {
                    float *ph = p + (r * G + h) * T8;
                    inv[r * G + h] = softmax_numerators(ph, tend[r]);
                    for (int64_t t = (tend[r] + 7) / 8 * 8; t < tw; t++) ph[t] = 0.0f;
                    // the group's heads are consecutive in the output: [G, D] per row
                    o[r * G + h] = out + ((s * Q + t0 + r) * Hq + h0 + h) * D;
                }
            weighted_sums(R * G, p, T8, kv, tw, D, o, live);
            for (int64_t j = 0; j < R * G; j++) {
                const __m256 vi = _mm256_set1_ps(inv[j]);
                for (int64_t d = 0; d < D; d += 8)
                    _mm256_storeu_ps(o[j] + d, _mm256_mul_ps(_mm256_loadu_ps(o[j] + d), vi));
            }
        }
        free(p);
        free(inv);
        free(o);
        free(live);
    }
    free(first);
}

// sum [N, D] = h + a (a == NULL: sum = h, may alias), out [N, D] = sum * rsqrt(mean(sum^2) + eps) * w. D % 8 == 0.
void add_rmsnorm_f32(const float *h, const float *a, const float *w, int64_t N, int64_t D, float eps, float *sum,
                     float *out) {
#pragma omp parallel for if (N >= ROWS_PER_REGION) schedule(static)
    for (int64_t n = 0; n < N; n++) {
        float *x = sum + n * D;
        const float *hx = h + n * D;
        if (a) {
            const float *y = a + n * D;
            for (int64_t d = 0; d < D; d += 8)
                _mm256_storeu_ps(x + d, _mm256_add_ps(_mm256_loadu_ps(hx + d), _mm256_loadu_ps(y + d)));
        }
        const float r = 1.0f / sqrtf(dot(x, x, D) / (float)D + eps);
        const __m256 vr = _mm256_set1_ps(r);
        float *o = out + n * D;
        for (int64_t d = 0; d < D; d += 8)
            _mm256_storeu_ps(o + d, _mm256_mul_ps(_mm256_mul_ps(_mm256_loadu_ps(x + d), vr), _mm256_loadu_ps(w + d)));
    }
}

// gate_up [N, 2I] -> out [N, I] = silu(gate) * up, silu(g) = g / (1 + exp(-g)). Element-wise: each output depends
// only on its own inputs (the vector / scalar split is by column, the same for every row).
void silu_mul_f32(const float *gate_up, int64_t N, int64_t I, float *out, int nthreads) {
    const int threads = N > 1 && N * I >= (1 << 13) ? nthreads : 1;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t n = 0; n < N; n++) {
        const float *g = gate_up + n * 2 * I, *u = g + I;
        float *o = out + n * I;
        int64_t i = 0;
        const __m256 one = _mm256_set1_ps(1.0f), zero = _mm256_setzero_ps();
        for (; i + 8 <= I; i += 8) {
            const __m256 gv = _mm256_loadu_ps(g + i);
            const __m256 sig = _mm256_add_ps(one, exp8(_mm256_sub_ps(zero, gv)));
            _mm256_storeu_ps(o + i, _mm256_mul_ps(_mm256_div_ps(gv, sig), _mm256_loadu_ps(u + i)));
        }
        for (; i < I; i++) o[i] = g[i] / (1.0f + expf(-g[i])) * u[i];
    }
}

// In-place rotary embedding on heads [0, H) of x [S, H, Q, D] (strides xs, xh, xq; D contiguous), HF rotate-half
// layout: x <- x * cos + roll(x, D/2) * ssin, with cos / ssin [S, Q, D] contiguous (ssin = cat(-sin, sin)).
// qlen [S]: only rows t < qlen[s] of sequence s (the rest is padding); NULL: all Q.
void rope_f32(float *x, int64_t S, int64_t H, int64_t Q, int64_t D, int64_t xs, int64_t xh, int64_t xq,
              const float *cos, const float *ssin, const int64_t *qlen) {
    const int64_t half = D / 2;
#pragma omp parallel for if (S * Q >= ROWS_PER_REGION) schedule(static)
    for (int64_t st = 0; st < S * Q; st++) {
        const int64_t s = st / Q, t = st % Q;
        if (qlen && t >= qlen[s]) continue;
        const float *c = cos + st * D, *sn = ssin + st * D;
        float tmp[1024];
        for (int64_t h = 0; h < H; h++) {
            float *v = x + s * xs + h * xh + t * xq;
            for (int64_t i = 0; i < D; i++) tmp[i] = v[i];
            for (int64_t i = 0; i < half; i++) v[i] = tmp[i] * c[i] + tmp[i + half] * sn[i];
            for (int64_t i = half; i < D; i++) v[i] = tmp[i] * c[i] + tmp[i - half] * sn[i];
        }
    }
}

// cache[s, h, pos[s, t], :] = x[s, h, t, :] for h < H (cache strides cs, ch, ct; x strides xs, xh, xq; D contiguous).
// With a block table (blocks != NULL): the paged cache [num_blocks, H, 1 << bshift, D], position p of sequence s in
// block blocks[s * nbt + (p >> bshift)] (cs its stride), row p & mask.
// qlen [S]: only rows t < qlen[s] of sequence s (the rest is padding); NULL: all Q.
void write_kv_f32(float *cache, int64_t cs, int64_t ch, int64_t ct, const float *x, int64_t xs, int64_t xh,
                  int64_t xq, const int64_t *pos, int64_t S, int64_t H, int64_t Q, int64_t D, const int64_t *qlen,
                  const int64_t *blocks, int64_t nbt, int64_t bshift) {
    const int64_t bmask = ((int64_t)1 << bshift) - 1;
    // one sequence per thread: its padding rows (without qlen) all write the same scratch position
#pragma omp parallel for if (S >= 2 && S * Q >= ROWS_PER_REGION) schedule(static)
    for (int64_t s = 0; s < S; s++)
        for (int64_t t = 0; t < (qlen ? qlen[s] : Q); t++) {
            const int64_t p = pos[s * Q + t];
            float *row = blocks ? cache + blocks[s * nbt + (p >> bshift)] * cs + (p & bmask) * ct : cache + s * cs + p * ct;
            for (int64_t h = 0; h < H; h++) {
                const float *src = x + s * xs + h * xh + t * xq;
                float *dst = row + h * ch;
                for (int64_t i = 0; i < D; i++) dst[i] = src[i];
            }
        }
}

// The argmax of one row r[0..V): torch.argmax's answer, the first index of the maximum, NaN counting as larger
// than every number (the first NaN wins). Two passes: the maximum (and whether any NaN is present), then the first
// index holding it.
static int64_t argmax_row(const float *r, int64_t V) {
    const int64_t V8 = V / 8 * 8;
    __m256 vmx = _mm256_set1_ps(-INFINITY), unord = _mm256_setzero_ps();
    for (int64_t i = 0; i < V8; i += 8) {
        const __m256 v = _mm256_loadu_ps(r + i);
        vmx = _mm256_max_ps(vmx, v);
        unord = _mm256_or_ps(unord, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
    }
    float lanes[8], mx = -INFINITY;
    int nan = _mm256_movemask_ps(unord) != 0;
    _mm256_storeu_ps(lanes, vmx);
    for (int j = 0; j < 8; j++) mx = lanes[j] > mx ? lanes[j] : mx;
    for (int64_t i = V8; i < V; i++) {
        nan |= r[i] != r[i];
        mx = r[i] > mx ? r[i] : mx;
    }
    int64_t best = 0;
    if (nan) {
        while (r[best] == r[best]) best++;
        return best;
    }
    const __m256 vm = _mm256_set1_ps(mx);
    int64_t i = 0;
    for (; i < V8; i += 8) {
        const int hit = _mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(r + i), vm, _CMP_EQ_OQ));
        if (hit) break;
    }
    // the first hit inside the vector (or in the tail)
    while (r[i] != mx) i++;
    return i;
}

// out[n] = argmax_row of x[n, 0..V) (row n at x + n * stride). Rows are independent.
void argmax_rows_f32(const float *x, int64_t N, int64_t V, int64_t stride, int64_t *out, int nthreads) {
    const int threads = N > 1 && N * V >= (1 << 16) ? nthreads : 1;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t n = 0; n < N; n++) out[n] = argmax_row(x + n * stride, V);
}

// Structured outputs: row rows[r] of x gets -inf at every token whose bit is clear in bitmask row r (bit t % 32 of
// word t / 32 set: token t allowed). Words all set are skipped, words all clear filled: a JSON grammar refuses most
// of a vocabulary.
void apply_bitmask_f32(float *x, int64_t V, int64_t stride, const int32_t *mask, int64_t W, const int64_t *rows,
                       int64_t R) {
    for (int64_t r = 0; r < R; r++) {
        float *row = x + rows[r] * stride;
        const uint32_t *m = (const uint32_t *)(mask + r * W);
        for (int64_t w = 0; w < W && w * 32 < V; w++) {
            const uint32_t bits = m[w];
            if (bits == 0xFFFFFFFFu) continue;
            const int64_t base = w * 32, n = V - base < 32 ? V - base : 32;
            for (int64_t j = 0; j < n; j++)
                if (!((bits >> j) & 1u)) row[base + j] = -INFINITY;
        }
    }
}

// Greedy verification: per request b, its rows rows[b, 0..K] of x score its drafts drafts[b, 0..K) (-1 padded: the
// first -1 ends them) and the bonus position. Accepts drafts while each equals its row's argmax and emits the
// argmax of the first row whose draft differs (or of the bonus row), walking the rows in order: a request costs
// its accepted drafts + 1 argmaxes, not K + 1. Writes the emitted token and the accepted count per request.
void verify_greedy_f32(const float *x, int64_t V, int64_t stride, int64_t B, int64_t K, const int64_t *rows,
                       const int64_t *drafts, int64_t *out_token, int64_t *num_accepted, int nthreads) {
    const int threads = B > 1 ? nthreads : 1;
#pragma omp parallel for num_threads(threads) schedule(dynamic, 1)
    for (int64_t b = 0; b < B; b++) {
        int64_t j = 0, tok;
        for (;; j++) {
            const int64_t draft = j < K ? drafts[b * K + j] : -1;
            tok = argmax_row(x + rows[b * (K + 1) + j] * stride, V);
            if (draft < 0 || tok != draft) break;
        }
        out_token[b] = tok;
        num_accepted[b] = j;
    }
}

// ---------------------------------------------------------------------------- sampled verification
// The distribution of a row is softmax(s * x) over its V logits (s = 1 / temperature). Three passes over a row:
// the maximum, the weights w = exp(s * (x - max)) into a per-thread scratch row with their total (float lanes, the
// total in double), then, to sample, an inverse-CDF scan in blocks of 8 (block sums added in double). A token of
// zero weight is never drawn: past the end (rounding), the last token of nonzero weight is taken.

typedef struct {
    float *w;
    double total;
} RowWeights;

static __thread float *row_scratch;
static __thread int64_t row_scratch_cap;

static RowWeights row_weights(const float *r, int64_t V, float s) {
    if (row_scratch_cap < V) {
        free(row_scratch);
        row_scratch = aligned_alloc(64, (size_t)((V + 15) / 16 * 64));
        row_scratch_cap = V;
    }
    float *w = row_scratch;
    const int64_t V8 = V / 8 * 8;
    __m256 vmx = _mm256_set1_ps(-INFINITY);
    for (int64_t i = 0; i < V8; i += 8) vmx = _mm256_max_ps(vmx, _mm256_loadu_ps(r + i));
    float lanes[8], mx = -INFINITY;
    _mm256_storeu_ps(lanes, vmx);
    for (int j = 0; j < 8; j++) mx = lanes[j] > mx ? lanes[j] : mx;
    for (int64_t i = V8; i < V; i++) mx = r[i] > mx ? r[i] : mx;
    const __m256 vm = _mm256_set1_ps(mx), vs = _mm256_set1_ps(s);
    // the total in double lanes: a float running sum over ~V / 8 terms would drift from the scan's sums by 1e-6
    __m256d acc0 = _mm256_setzero_pd(), acc1 = acc0;
    int64_t i = 0;
    for (; i < V8; i += 8) {
        const __m256 a = exp8(_mm256_mul_ps(_mm256_sub_ps(_mm256_loadu_ps(r + i), vm), vs));
        _mm256_storeu_ps(w + i, a);
        acc0 = _mm256_add_pd(acc0, _mm256_cvtps_pd(_mm256_castps256_ps128(a)));
        acc1 = _mm256_add_pd(acc1, _mm256_cvtps_pd(_mm256_extractf128_ps(a, 1)));
    }
    double dl[4];
    _mm256_storeu_pd(dl, _mm256_add_pd(acc0, acc1));
    double total = (dl[0] + dl[1]) + (dl[2] + dl[3]);
    for (; i < V; i++) {
        // the tail one lane at a time (x - max <= 0, so expf never overflows)
        w[i] = mx == -INFINITY ? 0.0f : expf((r[i] - mx) * s);
        total += w[i];
    }
    if (mx == -INFINITY)
        for (int64_t j = 0; j < V; j++) w[j] = 0.0f;
    return (RowWeights){w, mx == -INFINITY ? 0.0 : total};
}

// The first token whose cumulative weight exceeds point (point < the total).
static int64_t inverse_cdf(const float *w, int64_t V, double point) {
    const int64_t V8 = V / 8 * 8;
    double cum = 0.0;
    int64_t i = 0;
    for (; i < V8; i += 8) {
        const double b = hsum8(_mm256_loadu_ps(w + i));
        if (cum + b > point) break;
        cum += b;
    }
    for (; i < V; i++) {
        cum += w[i];
        if (cum > point && w[i] > 0.0f) return i;
    }
    int64_t last = V - 1;
    while (last > 0 && w[last] <= 0.0f) last--;
    return last;
}

// Per request b, its rows rows[b, 0..K] of x (row stride `stride`) score its drafts drafts[b, 0..K) (-1 padded:
// the first -1 ends them) and the bonus position. Walks the rows in order and stops at the first rejection, so a
// request costs its accepted drafts + 1 rows, not K + 1.
//   strict (u_accept NULL): sample row j with u_sample[b, j]; accept while the sample equals the draft; emit the
//     sample at the first mismatch (or at the bonus row).
//   probabilistic, one-hot draft distribution (u_accept [B, K]): accept draft j while u_accept[b, j] < p_j(draft);
//     at the first rejection emit a sample of p_j without the rejected token (p_j itself if nothing else has
//     weight); after every draft, a sample of the bonus row.
// Writes the emitted token and the accepted count per request. u_* are float32 in [0, 1).
void verify_sampled_f32(const float *x, int64_t V, int64_t stride, int64_t B, int64_t K, const int64_t *rows,
                        const int64_t *drafts, const float *scale, const float *u_accept, const float *u_sample,
                        int64_t *out_token, int64_t *num_accepted, int nthreads) {
    const int threads = B > 1 ? nthreads : 1;
#pragma omp parallel for num_threads(threads) schedule(dynamic, 1)
    for (int64_t b = 0; b < B; b++) {
        int64_t j = 0, tok = -1;
        for (;; j++) {
            const int64_t draft = j < K ? drafts[b * K + j] : -1;
            const RowWeights rw = row_weights(x + rows[b * (K + 1) + j] * stride, V, scale[b]);
            const double us = u_sample[b * (K + 1) + j];
            if (u_accept == NULL || draft < 0) {
                tok = inverse_cdf(rw.w, V, us * rw.total);
                if (draft >= 0 && tok == draft) continue;
                break;
            }
            if ((double)u_accept[b * K + j] * rw.total < (double)rw.w[draft]) continue;
            // the residual: p without the rejected draft (p itself when the draft held all the weight)
            const double rest = rw.total - rw.w[draft];
            if (rest > 0.0) rw.w[draft] = 0.0f;
            tok = inverse_cdf(rw.w, V, us * (rest > 0.0 ? rest : rw.total));
            break;
        }
        out_token[b] = tok;
        num_accepted[b] = j;
    }
}
