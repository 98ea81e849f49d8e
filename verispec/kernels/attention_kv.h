// Attention over the paged KV cache (ops.c's attention_f32), one instance per K/V storage type: ops.c includes this
// file once per type with KV_T (the element type), KV_NAME(x) (x with the type's suffix), KLOAD8(p) / KLOAD16(p)
// (8 / 16 floats from KV_T *p) defined. Every instance computes in float32 the same way; only the loads differ
// (float16 and bfloat16 widen exactly to float32), so an instance reading float16 keys gives the float32 instance's
// result on those keys widened.
#ifndef ATTENTION_KV_COMMON
#define ATTENTION_KV_COMMON
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

#define DOT_PASS(NAME, VEC, VL, ZERO, LOAD, KLOAD, FMA, FOLD)                                                         \
    static inline __attribute__((always_inline)) void NAME(const int N, const float *q, int64_t qh,          \
                                                           const KV_T *k0, const KV_T *k1, const KV_T *k2,   \
                                                           const KV_T *k3, int64_t D, __m128 *out) {          \
        VEC a[DOT_HEADS][4];                                                                                   \
        for (int h = 0; h < N; h++)                                                                            \
            for (int j = 0; j < 4; j++) a[h][j] = ZERO();                                                      \
        for (int64_t d = 0; d < D; d += VL) {                                                                  \
            const VEC c0 = KLOAD(k0 + d), c1 = KLOAD(k1 + d), c2 = KLOAD(k2 + d), c3 = KLOAD(k3 + d);         \
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
#else
// in 16 registers: 12 accumulators and a query vector (GCC takes the key vectors as memory operands)
#define DOT_HEADS 3
#endif

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
#define WS_KLOAD KLOAD16
#define WS_STORE _mm512_storeu_ps
#else
#define WS_VEC __m256
#define WS_VL 8
#define WS_REGS 14
#define WS_ZERO _mm256_setzero_ps
#define WS_SET1 _mm256_set1_ps
#define WS_FMA _mm256_fmadd_ps
#define WS_KLOAD KLOAD8
#define WS_STORE _mm256_storeu_ps
#endif
#define WS_MAX_HEADS 6

// Query rows of one sequence and head group taken together (up to this many): each key and value row is read once
// for all of them.
#define ATT_ROWS 8
#endif  // ATTENTION_KV_COMMON

#if defined(__AVX512F__)
DOT_PASS(KV_NAME(dot_pass16), __m512, 16, _mm512_setzero_ps, _mm512_loadu_ps, KLOAD16, _mm512_fmadd_ps, FOLD16)
#endif
DOT_PASS(KV_NAME(dot_pass8), __m256, 8, _mm256_setzero_ps, _mm256_loadu_ps, KLOAD8, _mm256_fmadd_ps, FOLD8)

static inline __attribute__((always_inline)) void KV_NAME(dot_pass)(const int N, const float *q, int64_t qh,
                                                           const KV_T *k0, const KV_T *k1, const KV_T *k2,
                                                           const KV_T *k3, int64_t D, __m128 *out) {
#if defined(__AVX512F__)
    if (D % 16 == 0) {
        KV_NAME(dot_pass16)(N, q, qh, k0, k1, k2, k3, D, out);
        return;
    }
#endif
    KV_NAME(dot_pass8)(N, q, qh, k0, k1, k2, k3, D, out);
}

// dot_pass over G heads (G a constant at each call, at most WS_MAX_HEADS): passes of DOT_HEADS, then the rest.
static inline __attribute__((always_inline)) void KV_NAME(dot_heads)(const int G, const float *q, int64_t qh,
                                                            const KV_T *k0, const KV_T *k1, const KV_T *k2,
                                                            const KV_T *k3, int64_t D, __m128 *out) {
    int h = 0;
    for (; h + DOT_HEADS <= G; h += DOT_HEADS) KV_NAME(dot_pass)(DOT_HEADS, q + h * qh, qh, k0, k1, k2, k3, D, out + h);
    if (G - h == 1) KV_NAME(dot_pass)(1, q + h * qh, qh, k0, k1, k2, k3, D, out + h);
#if DOT_HEADS > 2
    else if (G - h == 2) KV_NAME(dot_pass)(2, q + h * qh, qh, k0, k1, k2, k3, D, out + h);
    else if (G - h == 3) KV_NAME(dot_pass)(3, q + h * qh, qh, k0, k1, k2, k3, D, out + h);
    else if (G - h == 4) KV_NAME(dot_pass)(4, q + h * qh, qh, k0, k1, k2, k3, D, out + h);
    else if (G - h == 5) KV_NAME(dot_pass)(5, q + h * qh, qh, k0, k1, k2, k3, D, out + h);
#endif
}

// Where key row t of one sequence and KV head lies: a contiguous cache view (blocks NULL: k + t * kt), or a paged
// cache whose block table row `blocks` maps position t to block blocks[t >> shift], row t & mask of that block
// (bstride floats apart). The value row is voff floats after its key row (V heads follow K heads in the cache).
typedef struct KV_NAME(KVRows) {
    const KV_T *k;
    const int64_t *blocks;
    int64_t shift, mask, bstride, kt, voff;
} KV_NAME(KVRows);

static inline __attribute__((always_inline)) const KV_T *KV_NAME(key_row)(const KV_NAME(KVRows) *r, int64_t t) {
    return r->blocks ? r->k + r->blocks[t >> r->shift] * r->bstride + (t & r->mask) * r->kt : r->k + t * r->kt;
}


// R vectors of output for G heads (G, R constants at each call): p [G rows, pstride apart], head h's output at o[h];
// live: bit t set where some head's weight at t is not zero.
static inline __attribute__((always_inline)) void KV_NAME(ws_tile)(const int G, const int R, const float *p, int64_t pstride,
                                                          const uint8_t *live, const KV_NAME(KVRows) *kv, int64_t T,
                                                          float *const *o, int64_t d0) {
    WS_VEC acc[WS_MAX_HEADS][8];
    for (int h = 0; h < G; h++)
        for (int j = 0; j < R; j++) acc[h][j] = WS_ZERO();
    for (int64_t t = 0; t < T; t++) {
        if (!(live[t >> 3] >> (t & 7) & 1)) continue;
        const KV_T *vt = KV_NAME(key_row)(kv, t) + kv->voff + d0;
        WS_VEC vv[8];
        for (int j = 0; j < R; j++) vv[j] = WS_KLOAD(vt + WS_VL * j);
        for (int h = 0; h < G; h++) {
            const WS_VEC w = WS_SET1(p[h * pstride + t]);
            for (int j = 0; j < R; j++) acc[h][j] = WS_FMA(w, vv[j], acc[h][j]);
        }
    }
    for (int h = 0; h < G; h++)
        for (int j = 0; j < R; j++) WS_STORE(o[h] + d0 + WS_VL * j, acc[h][j]);
}

// The widest register tiles that fit (G heads x R vectors + R value vectors <= WS_REGS), then narrower ones.
static inline __attribute__((always_inline)) void KV_NAME(ws_heads)(const int G, const float *p, int64_t pstride,
                                                           const uint8_t *live, const KV_NAME(KVRows) *kv, int64_t T,
                                                           int64_t D, float *const *o) {
    int64_t d0 = 0;
    if ((G + 1) * 8 <= WS_REGS)
        for (; d0 + 8 * WS_VL <= D; d0 += 8 * WS_VL) KV_NAME(ws_tile)(G, 8, p, pstride, live, kv, T, o, d0);
    if ((G + 1) * 4 <= WS_REGS)
        for (; d0 + 4 * WS_VL <= D; d0 += 4 * WS_VL) KV_NAME(ws_tile)(G, 4, p, pstride, live, kv, T, o, d0);
    for (; d0 + 2 * WS_VL <= D; d0 += 2 * WS_VL) KV_NAME(ws_tile)(G, 2, p, pstride, live, kv, T, o, d0);
    for (; d0 + WS_VL <= D; d0 += WS_VL) KV_NAME(ws_tile)(G, 1, p, pstride, live, kv, T, o, d0);
    for (; d0 < D; d0 += 8)  // AVX-512 build with D % 16 == 8
        for (int h = 0; h < G; h++) {
            __m256 acc = _mm256_setzero_ps();
            for (int64_t t = 0; t < T; t++)
                if (p[h * pstride + t] != 0.0f)
                    acc = _mm256_fmadd_ps(_mm256_set1_ps(p[h * pstride + t]), KLOAD8(KV_NAME(key_row)(kv, t) + kv->voff + d0), acc);
            _mm256_storeu_ps(o[h] + d0, acc);
        }
}

// ws_heads for any number of heads (n, weights p [n rows, pstride apart], outputs o [n]): passes of up to
// WS_MAX_HEADS, each reading the value rows once for all its heads. live: (T + 7) / 8 bytes of scratch.
static __attribute__((noinline)) void KV_NAME(weighted_sums)(int64_t n, const float *p, int64_t pstride, const KV_NAME(KVRows) *kv,
                                                    int64_t T, int64_t D, float *const *o,
                                                    uint8_t *live) {
    for (int64_t h0 = 0; h0 < n; h0 += WS_MAX_HEADS) {
        const float *ph = p + h0 * pstride;
        float *const *oh = o + h0;
        const int64_t g = n - h0 < WS_MAX_HEADS ? n - h0 : WS_MAX_HEADS;
        live_keys(g, ph, pstride, T, live);
        switch (g) {
            case 1: KV_NAME(ws_heads)(1, ph, pstride, live, kv, T, D, oh); break;
            case 2: KV_NAME(ws_heads)(2, ph, pstride, live, kv, T, D, oh); break;
            case 3: KV_NAME(ws_heads)(3, ph, pstride, live, kv, T, D, oh); break;
            case 4: KV_NAME(ws_heads)(4, ph, pstride, live, kv, T, D, oh); break;
            case 5: KV_NAME(ws_heads)(5, ph, pstride, live, kv, T, D, oh); break;
            default: KV_NAME(ws_heads)(6, ph, pstride, live, kv, T, D, oh); break;
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
static inline __attribute__((always_inline)) void KV_NAME(scores)(const int G, int64_t R, const float *q, int64_t qh,
                                                         int64_t qq, const KV_NAME(KVRows) *kv, int64_t T, int64_t D,
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
                    for (int64_t l = 0; l < D; l += 64 / (int64_t)sizeof(KV_T))
                        _mm_prefetch((const char *)(KV_NAME(key_row)(kv, u) + kv->voff + l), _MM_HINT_T0);
                fetched = 1;
            }
            __m128 sc[WS_MAX_HEADS];
            KV_NAME(dot_heads)(G, q + r * qq, qh, KV_NAME(key_row)(kv, t), KV_NAME(key_row)(kv, t1), KV_NAME(key_row)(kv, t2), KV_NAME(key_row)(kv, t3), D, sc);
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

// scores for any group size G: G a constant for G <= 6; larger groups one head at a time (the mask, hence the ends,
// are the same for every head). p [R, G, T8].
static inline __attribute__((always_inline)) void KV_NAME(any_scores)(int64_t G, int64_t R, const float *q, int64_t qh,
                                                             int64_t qq, const KV_NAME(KVRows) *kv, int64_t T, int64_t D,
                                                             const uint8_t *mrow, int64_t mq,
                                                             float scale, float softcap, float *p, int64_t T8,
                                                             int64_t *tend) {
    if (G == 1)
        KV_NAME(scores)(1, R, q, qh, qq, kv, T, D, mrow, mq, scale, softcap, p, T8, T8, tend);
    else if (G == 2)
        KV_NAME(scores)(2, R, q, qh, qq, kv, T, D, mrow, mq, scale, softcap, p, T8, 2 * T8, tend);
    else if (G == 3)
        KV_NAME(scores)(3, R, q, qh, qq, kv, T, D, mrow, mq, scale, softcap, p, T8, 3 * T8, tend);
    else if (G == 4)
        KV_NAME(scores)(4, R, q, qh, qq, kv, T, D, mrow, mq, scale, softcap, p, T8, 4 * T8, tend);
    else if (G == 5)
        KV_NAME(scores)(5, R, q, qh, qq, kv, T, D, mrow, mq, scale, softcap, p, T8, 5 * T8, tend);
    else if (G == 6)
        KV_NAME(scores)(6, R, q, qh, qq, kv, T, D, mrow, mq, scale, softcap, p, T8, 6 * T8, tend);
    else
        for (int64_t h = 0; h < G; h++)
            KV_NAME(scores)(1, R, q + h * qh, qh, qq, kv, T, D, mrow, mq, scale, softcap, p + h * T8, T8, G * T8,
                   tend);
}


// q: [S, Hq, Q, D] with strides (qs, qh, qq) in elements, D contiguous; k, v: [S, Hkv, T, D] with strides
// (ks, kh, kt) (the cache view; v shares k's strides), or, with a block table, the paged cache's K and V heads
// [num_blocks, Hkv, 1 << bshift, D] with strides (ks, kh, kt), sequence s's position t in block
// blocks[s * nbt + (t >> bshift)]; mask: [S, 1, Q, T] bool with strides (ms, mq), T contiguous,
// or NULL (attend to all T). out: [S, Q, Hq, D] contiguous (the layout o_proj reads). D % 8 == 0.
// softcap > 0 applies tanh(score / softcap) * softcap before the mask (Gemma 2 style).
// qlen [S]: sequence s has rows 0 .. qlen[s] - 1, the rest padding (not computed, out left as it was); NULL: Q each.
// Batch invariance: a row's scores, softmax (8-lane sums over t, padded with exact zeros) and weighted sum depend
// only on that row's q, keys and mask, never on S, T, the other rows or how the rows are grouped.
static void KV_NAME(attention)(const float *q, int64_t S, int64_t Hq, int64_t Q, int64_t D, int64_t qs, int64_t qh, int64_t qq,
                   const KV_T *k, const KV_T *v, int64_t Hkv, int64_t T, int64_t ks, int64_t kh, int64_t kt,
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
            const KV_NAME(KVRows) kr = {blocks ? k + g * kh : k + s * ks + g * kh, blocks ? blocks + s * nbt : NULL, bshift,
                               ((int64_t)1 << bshift) - 1, ks, kt, v - k};
            const KV_NAME(KVRows) *kv = &kr;
            const uint8_t *mrow = mask ? mask + s * ms + t0 * mq : NULL;
            const float *qv = q + s * qs + h0 * qh + t0 * qq;
            // one row (decode): R a constant, the row loop compiled away
            if (R == 1)
                KV_NAME(any_scores)(G, 1, qv, qh, qq, kv, T, D, mrow, mq, scale, softcap, p, T8, tend);
            else
                KV_NAME(any_scores)(G, R, qv, qh, qq, kv, T, D, mrow, mq, scale, softcap, p, T8, tend);
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
            KV_NAME(weighted_sums)(R * G, p, T8, kv, tw, D, o, live);
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
