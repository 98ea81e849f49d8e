// y[M, N] = x[M, K] @ W[N, K]^T with W kept in 32-weight quantized blocks, float32 activations.
// Built twice by verispec/kernels/build.py: AVX2 + FMA (8 lanes) and AVX-512F (16 lanes); the CPU picks one.
//
// Block layouts (repacked once at load time from GGUF's Q4_0 / Q4_1 / Q4_K / Q5_0 / Q8_0 / Q6_K by
// verispec/kernels/qweight.py):
//   q4: float d, float m, uint64 qw[2]  (24 bytes). qw[h] holds weights 16h..16h+15: its low 32 bits hold the even
//       ones (nibble t = weight 16h+2t), its high 32 bits the odd ones (nibble t = weight 16h+2t+1);
//       weight = d * q + m.
//   q8: float d, int8 q[32]             (36 bytes); weight j = d * q[j].
//   q6: float d0, float d1, int8 q[32]  (40 bytes); weight j = d_(j/16) * q[j] (Q6_K: q in -32..31, d = d * scale).
// With that nibble order one 64-bit broadcast + one per-lane variable shift puts every weight's nibble in the low
// bits of its own lane (no cross-lane shuffle on AVX2; AVX-512 then looks the 16 possible values of a block up with
// one vpermps). Every weight comes out as exactly the float32 value gguf.quants.dequantize gives (d*q is exact, so
// d*q+m rounds once, as numpy's (d * q) + m does; Q4_0's d*(q-8) is q4 with m = -8d, exact either way): the model
// is the same model, only the summation order of the dot products is this kernel's.
//
// Determinism: every output element y[m, n] is ONE VL-lane FMA chain over k = 0, VL, 2VL, ... followed by a fixed
// horizontal sum, whatever M is, whichever register tile (1..8 rows, 1..4 columns) a row falls in and however many
// threads run. A row's result never depends on the batch, so plain decoding and speculative verification stay
// bitwise identical. Independent chains (rows x columns) hide the FMA latency.
#include <immintrin.h>
#include <stdint.h>
#include "kernels.h"
#include <string.h>

#define QK 32
#define NCOLS 16     // output columns per work item
#define TILE_M 32    // rows whose x stays cached while the columns are swept (up to 32 rows read the weights once)
#define BSIZE_q4 24
#define BSIZE_q8 36
#define BSIZE_q6 40

static inline float load_f32(const uint8_t *p) {
    float f;
    memcpy(&f, p, 4);
    return f;
}

static inline int64_t load_i64(const uint8_t *p) {
    int64_t v;
    memcpy(&v, p, 8);
    return v;
}

#if defined(__AVX512F__)
#define VL 16
#define MID_COLS 4   // 3-4 row tiles: up to 4 x 4 accumulators + 8 expanded weight vectors (32 registers)
// up to 6 rows (verifying 5 drafts) in one tile of 4 columns: 24 accumulators; the weights of 4 columns, one
// block at a time, stay in registers too
#define ONE_TILE_ROWS 6
#define ROW_TILES_WIDE(X, T) X(T, 5, 4) X(T, 6, 4)
// more rows are split evenly into as few tiles as fit (7: 4 + 3, 9: 5 + 4, 32: 6 + 6 + 5 + 5 + 5 + 5)
static inline int64_t row_group(int64_t m) {
    const int64_t tiles = (m + ONE_TILE_ROWS - 1) / ONE_TILE_ROWS;
    return (m + tiles - 1) / tiles;
}
typedef __m512 vf;
#define vzero _mm512_setzero_ps
#define vload _mm512_loadu_ps
#define vstore _mm512_store_ps
#define vfma _mm512_fmadd_ps

static inline float vsum(__m512 v) {
    const __m256 h = _mm256_add_ps(_mm512_castps512_ps256(v), _mm512_extractf32x8_ps(v, 1));
    const __m128 s = _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
    const __m128 t = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(t, _mm_movehdup_ps(t)));
}

// vsum of n <= 16 vectors at once, each one's lanes paired exactly as vsum pairs them (lo 8 + hi 8, lo 4 + hi 4,
// lanes 0+2 / 1+3, then 0+1), so every result is bitwise vsum's; 45 shuffles and adds instead of ~9 per vector.
static inline void vsum_n(const __m512 *a, int n, float *out) {
    __m512 v[16], h[8], s[4], t[2];
    for (int i = 0; i < 16; i++) v[i] = i < n ? a[i] : _mm512_setzero_ps();
    for (int i = 0; i < 8; i++)  // h[i] = [v2i lo8 + hi8 | v2i+1 lo8 + hi8]
        h[i] = _mm512_add_ps(_mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                             _mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], _MM_SHUFFLE(3, 2, 3, 2)));
    for (int i = 0; i < 4; i++)  // s[i]: 128-bit lane j = (lo4 + hi4) of vector 4i + j
        s[i] = _mm512_add_ps(_mm512_shuffle_f32x4(h[2 * i], h[2 * i + 1], _MM_SHUFFLE(2, 0, 2, 0)),
                             _mm512_shuffle_f32x4(h[2 * i], h[2 * i + 1], _MM_SHUFFLE(3, 1, 3, 1)));
    for (int i = 0; i < 2; i++)  // t[i]: lane j = [0+2, 1+3 of vector 8i + j, 0+2, 1+3 of vector 8i + 4 + j]
        t[i] = _mm512_add_ps(_mm512_shuffle_ps(s[2 * i], s[2 * i + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                             _mm512_shuffle_ps(s[2 * i], s[2 * i + 1], _MM_SHUFFLE(3, 2, 3, 2)));
    float r[16];  // r[4j + k] = sum of vector 4k + j
    _mm512_storeu_ps(r, _mm512_add_ps(_mm512_shuffle_ps(t[0], t[1], _MM_SHUFFLE(2, 0, 2, 0)),
                                      _mm512_shuffle_ps(t[0], t[1], _MM_SHUFFLE(3, 1, 3, 1))));
    for (int i = 0; i < n; i++) out[i] = r[(i % 4) * 4 + i / 4];
}
#define HAVE_VSUM_N 1

static inline void dequant_q4(const uint8_t *b, vf w[QK / VL]) {
    const __m512 iota = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    const __m512 table = _mm512_fmadd_ps(_mm512_set1_ps(load_f32(b)), iota, _mm512_set1_ps(load_f32(b + 4)));
    const __m512i shifts = _mm512_setr_epi32(0, 0, 4, 4, 8, 8, 12, 12, 16, 16, 20, 20, 24, 24, 28, 28);
    for (int h = 0; h < 2; h++) {  // vpermps reads only the low 4 bits of each index lane
        const __m512i idx = _mm512_srlv_epi32(_mm512_set1_epi64(load_i64(b + 8 + 8 * h)), shifts);
        w[h] = _mm512_permutexvar_ps(idx, table);
    }
}

static inline void dequant_q8(const uint8_t *b, vf w[QK / VL]) {
    const __m512 d = _mm512_set1_ps(load_f32(b));
    for (int h = 0; h < 2; h++) {
        const __m128i q = _mm_loadu_si128((const __m128i *)(b + 4 + 16 * h));
        w[h] = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(q)));
    }
}

static inline void dequant_q6(const uint8_t *b, vf w[QK / VL]) {
    for (int h = 0; h < 2; h++) {
        const __m128i q = _mm_loadu_si128((const __m128i *)(b + 8 + 16 * h));
        w[h] = _mm512_mul_ps(_mm512_set1_ps(load_f32(b + 4 * h)), _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(q)));
    }
}
#else
#define VL 8
#define MID_COLS 2   // 3-4 row tiles (16 vector registers)
// 5-8 rows (verifying 4-7 drafts) in one tile of a single column: up to 8 accumulators beside the block's 4
// expanded weight vectors, each row's x loads folded into its FMAs (faster than 4 + 1 rows; a 6-row tile is the
// fastest per row, so more rows go in groups of 6)
#define ONE_TILE_ROWS 8
#define ROW_TILES_WIDE(X, T) X(T, 5, 1) X(T, 6, 1) X(T, 7, 1) X(T, 8, 1)
// more rows in groups of 6
static inline int64_t row_group(int64_t m) { return m <= ONE_TILE_ROWS ? m : 6; }
typedef __m256 vf;
#define vzero _mm256_setzero_ps
#define vload _mm256_loadu_ps
#define vstore _mm256_store_ps
#define vfma _mm256_fmadd_ps

static inline float vsum(__m256 v) {
    const __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    const __m128 t = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(t, _mm_movehdup_ps(t)));
}

static inline void dequant_q4(const uint8_t *b, vf w[QK / VL]) {
    const __m256 d = _mm256_set1_ps(load_f32(b)), m = _mm256_set1_ps(load_f32(b + 4));
    const __m256i lo = _mm256_setr_epi32(0, 0, 4, 4, 8, 8, 12, 12), hi = _mm256_setr_epi32(16, 16, 20, 20, 24, 24, 28, 28);
    const __m256i mask = _mm256_set1_epi32(15);
    for (int h = 0; h < 2; h++) {
        const __m256i q = _mm256_set1_epi64x(load_i64(b + 8 + 8 * h));
        w[2 * h] = _mm256_fmadd_ps(d, _mm256_cvtepi32_ps(_mm256_and_si256(_mm256_srlv_epi32(q, lo), mask)), m);
        w[2 * h + 1] = _mm256_fmadd_ps(d, _mm256_cvtepi32_ps(_mm256_and_si256(_mm256_srlv_epi32(q, hi), mask)), m);
    }
}

static inline void dequant_q8(const uint8_t *b, vf w[QK / VL]) {
    const __m256 d = _mm256_set1_ps(load_f32(b));
    for (int i = 0; i < 4; i++) {
        const __m128i q = _mm_loadl_epi64((const __m128i *)(b + 4 + 8 * i));
        w[i] = _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q)));
    }
}

static inline void dequant_q6(const uint8_t *b, vf w[QK / VL]) {
    for (int i = 0; i < 4; i++) {
        const __m128i q = _mm_loadl_epi64((const __m128i *)(b + 8 + 8 * i));
        w[i] = _mm256_mul_ps(_mm256_set1_ps(load_f32(b + 4 * (i / 2))), _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q)));
    }
}
#endif

// y[r * N + c] = vsum(acc[r * C + c]) for an R x C register tile (several at once where vsum_n exists).
static inline void store_sums(const vf *acc, int R, int C, float *y, int64_t N) {
#ifdef HAVE_VSUM_N
    if (R * C > 4) {
        float s[32];
        for (int i = 0; i < R * C; i += 16) vsum_n(acc + i, R * C - i < 16 ? R * C - i : 16, s + i);
        for (int r = 0; r < R; r++)
            for (int c = 0; c < C; c++) y[r * N + c] = s[r * C + c];
        return;
    }
#endif
    for (int r = 0; r < R; r++)
        for (int c = 0; c < C; c++) y[r * N + c] = vsum(acc[r * C + c]);
}

// Few rows: C columns at a time, each block expanded into registers once and used by all R rows (each x vector
// loaded once per block and used for all C columns).
#define DEFINE_REG_KERNEL(NAME, T, R, C)                                                                      \
    static inline void NAME(const float *x, int64_t K, const uint8_t *w, int64_t row_bytes, float *y,         \
                            int64_t N) {                                                                    \
        vf acc[R][C];                                                                                       \
        for (int r = 0; r < R; r++)                                                                         \
            for (int c = 0; c < C; c++) acc[r][c] = vzero();                                                \
        for (int64_t b = 0; b < K / QK; b++) {                                                              \
            vf wv[C][QK / VL];                                                                              \
            for (int c = 0; c < C; c++) {                                                                   \
                _mm_prefetch((const char *)(w + (2 * C + c) * row_bytes + b * BSIZE_##T), _MM_HINT_T0);         \
                dequant_##T(w + c * row_bytes + b * BSIZE_##T, wv[c]);                                      \
            }                                                                                               \
            for (int r = 0; r < R; r++)                                                                     \
                for (int i = 0; i < QK / VL; i++) {                                                         \
                    const vf xv = vload(x + r * K + b * QK + VL * i);                                       \
                    for (int c = 0; c < C; c++) acc[r][c] = vfma(xv, wv[c][i], acc[r][c]);                  \
                }                                                                                           \
        }                                                                                                   \
        store_sums(&acc[0][0], R, C, y, N);                                                                 \
    }
#define REG(T, R, C) REG_(T, R, C)
#define REG_(T, R, C) reg_##T##_##R##x##C
// the single-column tile that finishes a row count's columns (the same code as REG(T, R, 1) where that is the tile)
#define REG1(T, R) reg1_##T##_##R
// One row count: tiles of C columns, then single columns.
#define ROWS_CASE(T, R, C)                                                                                    \
    case R:                                                                                                 \
        for (; n + C <= n1; n += C) REG(T, R, C)(x, K, w + n * row_bytes, row_bytes, y + n, N);             \
        for (; n < n1; n++) REG1(T, R)(x, K, w + n * row_bytes, row_bytes, y + n, N);                      \
        break;

// The register tile for each row count 1..ONE_TILE_ROWS (rows, columns): one list for the kernels and the dispatch.
#define ROW_TILES(X, T) X(T, 1, 4) X(T, 2, 4) X(T, 3, MID_COLS) X(T, 4, MID_COLS) ROW_TILES_WIDE(X, T)
// every row count row_group can ask for needs its case (a missing one would compute nothing), as in qgemm_i8_vnni.h
#define TILE_BIT(T, R, C) | (1ull << (R))
_Static_assert((0 ROW_TILES(TILE_BIT, q4)) == (2ull << ONE_TILE_ROWS) - 2, "ROW_TILES: row counts 1..ONE_TILE_ROWS");
#undef TILE_BIT
#define DEFINE_TILE(T, R, C) DEFINE_REG_KERNEL(REG(T, R, C), T, R, C) DEFINE_REG_KERNEL(REG1(T, R), T, R, 1)
// Entry point (ctypes): x [M, K] float32 contiguous, w [N, K/32 blocks] in the layouts above, y [M, N] float32.
// K must be a multiple of 32 (the Python side checks).
#define DEFINE_QGEMM(T)                                                                                       \
    ROW_TILES(DEFINE_TILE, T)                                                                                 \
    /* columns [n0, n1) of x [M <= ONE_TILE_ROWS, K]: one tile row group, every block expanded once per column */ \
    static void reg_rows_##T(const float *x, int64_t M, int64_t K, const uint8_t *w, int64_t row_bytes,      \
                             int64_t n0, int64_t n1, float *y, int64_t N) {                                 \
        int64_t n = n0;                                                                                     \
        switch (M) { ROW_TILES(ROWS_CASE, T) }                                                              \
    }                                                                                                       \
    void qgemm_##T(const float *x, int64_t M, int64_t K, const uint8_t *w, int64_t N, float *y, int nthreads) { \
        const int64_t row_bytes = K / QK * BSIZE_##T;                                                       \
        const int64_t nitems = (N + NCOLS - 1) / NCOLS;                                                     \
        _Pragma("omp parallel num_threads(nthreads)") {                                                     \
            /* TILE_M rows at a time (their x stays in L1) over all columns; static schedule: each thread */  \
            /* keeps the same columns for every row block, so its share of the weights stays in its L2 */     \
            for (int64_t m0 = 0; m0 < M; m0 += TILE_M) {                                                    \
                const int64_t m1 = M < m0 + TILE_M ? M : m0 + TILE_M;                                       \
                _Pragma("omp for schedule(static) nowait") for (int64_t it = 0; it < nitems; it++) {        \
                    const int64_t n0 = it * NCOLS, n1 = n0 + NCOLS < N ? n0 + NCOLS : N;                    \
                    /* row groups over the same columns (the item's weights stay in L1): row_group's sizes */ \
                    for (int64_t r = m0, g; r < m1; r += g) {                                               \
                        g = row_group(m1 - r);                                                              \
                        reg_rows_##T(x + r * K, g, K, w, row_bytes, n0, n1, y + r * N, N);                  \
                    }                                                                                       \
                }                                                                                           \
            }                                                                                               \
        }                                                                                                   \
    }

DEFINE_QGEMM(q4)
DEFINE_QGEMM(q8)
DEFINE_QGEMM(q6)
