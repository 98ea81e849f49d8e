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

// attention_kv.h once per K/V storage type (float16 and bfloat16 widen to float32 exactly)
#define KV_CAT2(a, b) a##_##b
#define KV_CAT(a, b) KV_CAT2(a, b)
#define KV_NAME(x) KV_CAT(x, KV_SFX)

#define KV_T float
#define KV_SFX f32kv
#define KLOAD8(p) _mm256_loadu_ps(p)
#define KLOAD16(p) _mm512_loadu_ps(p)
#include "attention_kv.h"
#undef KV_T
#undef KV_SFX
#undef KLOAD8
#undef KLOAD16

#define KV_T uint16_t
#define KV_SFX f16kv
#define KLOAD8(p) _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(p)))
#define KLOAD16(p) _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(p)))
#include "attention_kv.h"
#undef KV_SFX
#undef KLOAD8
#undef KLOAD16

#define KV_SFX bf16kv
#define KLOAD8(p) _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(p))), 16))
#define KLOAD16(p) \
    _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(p))), 16))
#include "attention_kv.h"
#undef KV_T
#undef KV_SFX
#undef KLOAD8
#undef KLOAD16

// The attention of attention_kv.h (shapes and strides there) over a cache storing K/V as kv_dtype (KV_F32,
// KV_F16, KV_BF16; strides in elements of that type).
void attention_f32(const float *q, int64_t S, int64_t Hq, int64_t Q, int64_t D, int64_t qs, int64_t qh, int64_t qq,
                   const void *k, const void *v, int64_t Hkv, int64_t T, int64_t ks, int64_t kh, int64_t kt,
                   const int64_t *blocks, int64_t nbt, int64_t bshift, const uint8_t *mask, int64_t ms, int64_t mq,
                   float scale, float softcap, float *out, const int64_t *qlen, int nthreads, int32_t kv_dtype) {
    if (kv_dtype == KV_F16)
        attention_f16kv(q, S, Hq, Q, D, qs, qh, qq, k, v, Hkv, T, ks, kh, kt, blocks, nbt, bshift, mask, ms, mq,
                        scale, softcap, out, qlen, nthreads);
    else if (kv_dtype == KV_BF16)
        attention_bf16kv(q, S, Hq, Q, D, qs, qh, qq, k, v, Hkv, T, ks, kh, kt, blocks, nbt, bshift, mask, ms, mq,
                         scale, softcap, out, qlen, nthreads);
    else
        attention_f32kv(q, S, Hq, Q, D, qs, qh, qq, k, v, Hkv, T, ks, kh, kt, blocks, nbt, bshift, mask, ms, mq,
                        scale, softcap, out, qlen, nthreads);
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
// float32 -> bfloat16, rounding to nearest even (as torch's conversion; NaN stays a quiet NaN)
static inline uint16_t to_bf16(float x) {
    uint32_t u;
    __builtin_memcpy(&u, &x, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return 0x7fc0;
    return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

// One head's D values into a cache row of kv_dtype (float16: F16C's rounding to nearest even, as torch's).
static inline void store_row(void *dst, const float *src, int64_t D, int32_t kv_dtype) {
    if (kv_dtype == KV_F16)
        for (int64_t i = 0; i < D; i += 8)
            _mm_storeu_si128((__m128i *)((uint16_t *)dst + i), _mm256_cvtps_ph(_mm256_loadu_ps(src + i), _MM_FROUND_TO_NEAREST_INT));
    else if (kv_dtype == KV_BF16)
        for (int64_t i = 0; i < D; i++) ((uint16_t *)dst)[i] = to_bf16(src[i]);
    else
        for (int64_t i = 0; i < D; i++) ((float *)dst)[i] = src[i];
}

void write_kv_f32(void *cache, int64_t cs, int64_t ch, int64_t ct, const float *x, int64_t xs, int64_t xh,
                  int64_t xq, const int64_t *pos, int64_t S, int64_t H, int64_t Q, int64_t D, const int64_t *qlen,
                  const int64_t *blocks, int64_t nbt, int64_t bshift, int32_t kv_dtype) {
    const int64_t bmask = ((int64_t)1 << bshift) - 1, esize = kv_dtype == KV_F32 ? 4 : 2;
    // one sequence per thread: its padding rows (without qlen) all write the same scratch position
#pragma omp parallel for if (S >= 2 && S * Q >= ROWS_PER_REGION) schedule(static)
    for (int64_t s = 0; s < S; s++)
        for (int64_t t = 0; t < (qlen ? qlen[s] : Q); t++) {
            const int64_t p = pos[s * Q + t];
            const int64_t row = blocks ? blocks[s * nbt + (p >> bshift)] * cs + (p & bmask) * ct : s * cs + p * ct;
            for (int64_t h = 0; h < H; h++)
                store_row((char *)cache + (row + h * ch) * esize, x + s * xs + h * xh + t * xq, D, kv_dtype);
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
