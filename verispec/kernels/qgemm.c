// y[M, N] = x[M, K] @ W[N, K]^T with W kept in 32-weight quantized blocks, float32 activations.
// Built twice by verispec/kernels/build.py: AVX2 + FMA (8 lanes) and AVX-512F (16 lanes); the CPU picks one.
//
// Block layouts (repacked once at load time from GGUF's Q4_0 / Q4_1 / Q8_0 by verispec/kernels/qweight.py):
//   q4: float d, float m, uint64 qw[2]  (24 bytes). qw[h] holds weights 16h..16h+15: its low 32 bits hold the even
//       ones (nibble t = weight 16h+2t), its high 32 bits the odd ones (nibble t = weight 16h+2t+1);
//       weight = d * q + m.
//   q8: float d, int8 q[32]             (36 bytes); weight j = d * q[j].
// With that nibble order one 64-bit broadcast + one per-lane variable shift puts every weight's nibble in the low
// bits of its own lane (no cross-lane shuffle on AVX2; AVX-512 then looks the 16 possible values of a block up with
// one vpermps). Every weight comes out as exactly the float32 value gguf.quants.dequantize gives (d*q is exact, so
// d*q+m rounds once, as numpy's (d * q) + m does; Q4_0's d*(q-8) is q4 with m = -8d, exact either way): the model
// is the same model, only the summation order of the dot products is this kernel's.
//
// Determinism: every output element y[m, n] is ONE VL-lane FMA chain over k = 0, VL, 2VL, ... followed by a fixed
// horizontal sum, in both code paths (weights expanded into registers for a few rows, into a float32 strip for many),
// whatever M is, whichever tile a row falls in and however many threads run. A row's result never depends on the
// batch, so plain decoding and speculative verification stay bitwise identical. Independent chains (rows x columns)
// hide the FMA latency.
#include <immintrin.h>
#include <stdint.h>
#include <string.h>

#define QK 32
#define NCOLS 16     // output columns per work item
#define MAX_K 16384  // widest K the per-thread strip holds (NCOLS * MAX_K floats)
#define SMALL_M 8    // up to this many rows: expand into registers (tiles of <= 4 rows); above: a float32 strip
#define BSIZE_q4 24
#define BSIZE_q8 36

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
#define WIDE_COLS 2  // 8-row tiles: 8 x 2 accumulators (32 vector registers)
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
#else
#define VL 8
#define WIDE_COLS 1  // 8-row tiles: 8 accumulators (16 vector registers)
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
#endif

// Few rows: C columns at a time, each block expanded into registers once and used by all R rows.
#define DEFINE_REG_KERNEL(T, R, C)                                                                            \
    static inline void reg_##T##_##R##x##C(const float *x, int64_t K, const uint8_t *w, int64_t row_bytes,   \
                                           float *y, int64_t N) {                                           \
        vf acc[R][C];                                                                                       \
        for (int r = 0; r < R; r++)                                                                         \
            for (int c = 0; c < C; c++) acc[r][c] = vzero();                                                \
        for (int64_t b = 0; b < K / QK; b++) {                                                              \
            for (int c = 0; c < C; c++) {                                                                   \
                vf wv[QK / VL];                                                                             \
                _mm_prefetch((const char *)(w + (2 * C + c) * row_bytes + b * BSIZE_##T), _MM_HINT_T0);         \
                dequant_##T(w + c * row_bytes + b * BSIZE_##T, wv);                                         \
                for (int r = 0; r < R; r++)                                                                 \
                    for (int i = 0; i < QK / VL; i++)                                                       \
                        acc[r][c] = vfma(vload(x + r * K + b * QK + VL * i), wv[i], acc[r][c]);             \
            }                                                                                               \
        }                                                                                                   \
        for (int r = 0; r < R; r++)                                                                         \
            for (int c = 0; c < C; c++) y[r * N + c] = vsum(acc[r][c]);                                     \
    }

// Many rows: an R x C register tile over a float32 strip of expanded columns (ws [C][K], stride K).
#define DEFINE_STRIP_KERNEL(R, C)                                                                             \
    static inline void strip_##R##x##C(const float *x, int64_t K, const float *ws, float *y, int64_t N) {   \
        vf acc[R][C];                                                                                       \
        for (int r = 0; r < R; r++)                                                                         \
            for (int c = 0; c < C; c++) acc[r][c] = vzero();                                                \
        for (int64_t k = 0; k < K; k += VL) {                                                               \
            vf wv[C];                                                                                       \
            for (int c = 0; c < C; c++) wv[c] = vload(ws + c * K + k);                                      \
            for (int r = 0; r < R; r++) {                                                                   \
                const vf xv = vload(x + r * K + k);                                                         \
                for (int c = 0; c < C; c++) acc[r][c] = vfma(xv, wv[c], acc[r][c]);                         \
            }                                                                                               \
        }                                                                                                   \
        for (int r = 0; r < R; r++)                                                                         \
            for (int c = 0; c < C; c++) y[r * N + c] = vsum(acc[r][c]);                                     \
    }
DEFINE_STRIP_KERNEL(4, 3)
DEFINE_STRIP_KERNEL(4, 1)
DEFINE_STRIP_KERNEL(1, 3)
DEFINE_STRIP_KERNEL(1, 1)

static void strip_rows(const float *x, int64_t M, int64_t K, const float *ws, int64_t ncols, float *y, int64_t N) {
    int64_t m = 0;
    for (; m + 4 <= M; m += 4) {
        int64_t c = 0;
        for (; c + 3 <= ncols; c += 3) strip_4x3(x + m * K, K, ws + c * K, y + m * N + c, N);
        for (; c < ncols; c++) strip_4x1(x + m * K, K, ws + c * K, y + m * N + c, N);
    }
    for (; m < M; m++) {
        int64_t c = 0;
        for (; c + 3 <= ncols; c += 3) strip_1x3(x + m * K, K, ws + c * K, y + m * N + c, N);
        for (; c < ncols; c++) strip_1x1(x + m * K, K, ws + c * K, y + m * N + c, N);
    }
}

// Entry point (ctypes): x [M, K] float32 contiguous, w [N, K/32 blocks] in the layouts above, y [M, N] float32.
// K must be a multiple of 32 and at most MAX_K (the Python side checks both).
#define DEFINE_QGEMM(T)                                                                                       \
    DEFINE_REG_KERNEL(T, 1, 4)                                                                                \
    DEFINE_REG_KERNEL(T, 1, 1)                                                                                \
    DEFINE_REG_KERNEL(T, 2, 4)                                                                                \
    DEFINE_REG_KERNEL(T, 2, 1)                                                                                \
    DEFINE_REG_KERNEL(T, 3, 2)                                                                                \
    DEFINE_REG_KERNEL(T, 3, 1)                                                                                \
    DEFINE_REG_KERNEL(T, 4, 2)                                                                                \
    DEFINE_REG_KERNEL(T, 4, 1)                                                                                \
    DEFINE_REG_KERNEL(T, 8, WIDE_COLS)                                                                        \
    DEFINE_REG_KERNEL(T, 8, 1)                                                                                \
    static void reg_rows_##T(const float *x, int64_t M, int64_t K, const uint8_t *w, int64_t row_bytes,      \
                             int64_t n0, int64_t n1, float *y, int64_t N) {                                 \
        for (int64_t m0 = 0; m0 < M;) {                                                                     \
            const int64_t rows = M - m0 >= 8 ? 8 : (M - m0 < 4 ? M - m0 : 4);                               \
            const float *xt = x + m0 * K;                                                                   \
            float *yt = y + m0 * N;                                                                         \
            int64_t n = n0;                                                                                 \
            if (rows == 1) {                                                                                \
                for (; n + 4 <= n1; n += 4) reg_##T##_1x4(xt, K, w + n * row_bytes, row_bytes, yt + n, N);  \
                for (; n < n1; n++) reg_##T##_1x1(xt, K, w + n * row_bytes, row_bytes, yt + n, N);          \
            } else if (rows == 2) {                                                                         \
                for (; n + 4 <= n1; n += 4) reg_##T##_2x4(xt, K, w + n * row_bytes, row_bytes, yt + n, N);  \
                for (; n < n1; n++) reg_##T##_2x1(xt, K, w + n * row_bytes, row_bytes, yt + n, N);          \
            } else if (rows == 3) {                                                                         \
                for (; n + 2 <= n1; n += 2) reg_##T##_3x2(xt, K, w + n * row_bytes, row_bytes, yt + n, N);  \
                for (; n < n1; n++) reg_##T##_3x1(xt, K, w + n * row_bytes, row_bytes, yt + n, N);          \
            } else if (rows == 4) {                                                                         \
                for (; n + 2 <= n1; n += 2) reg_##T##_4x2(xt, K, w + n * row_bytes, row_bytes, yt + n, N);  \
                for (; n < n1; n++) reg_##T##_4x1(xt, K, w + n * row_bytes, row_bytes, yt + n, N);          \
            } else {                                                                                        \
                for (; n + WIDE_COLS <= n1; n += WIDE_COLS)                                                 \
                    reg_##T##_8x##WIDE_COLS(xt, K, w + n * row_bytes, row_bytes, yt + n, N);                \
                for (; n < n1; n++) reg_##T##_8x1(xt, K, w + n * row_bytes, row_bytes, yt + n, N);          \
            }                                                                                               \
            m0 += rows;                                                                                     \
        }                                                                                                   \
    }                                                                                                       \
    void qgemm_##T(const float *x, int64_t M, int64_t K, const uint8_t *w, int64_t N, float *y, int nthreads) { \
        const int64_t row_bytes = K / QK * BSIZE_##T;                                                       \
        const int64_t nitems = (N + NCOLS - 1) / NCOLS;                                                     \
        _Pragma("omp parallel num_threads(nthreads)") {                                                     \
            static __thread float strip[NCOLS * MAX_K] __attribute__((aligned(64)));                        \
            _Pragma("omp for schedule(static)") for (int64_t it = 0; it < nitems; it++) {                   \
                const int64_t n0 = it * NCOLS, n1 = n0 + NCOLS < N ? n0 + NCOLS : N;                        \
                if (M <= SMALL_M) {                                                                         \
                    reg_rows_##T(x, M, K, w, row_bytes, n0, n1, y, N);                                      \
                    continue;                                                                               \
                }                                                                                           \
                for (int64_t n = n0; n < n1; n++)                                                           \
                    for (int64_t b = 0; b < K / QK; b++) {                                                  \
                        vf wv[QK / VL];                                                                     \
                        dequant_##T(w + n * row_bytes + b * BSIZE_##T, wv);                                 \
                        for (int i = 0; i < QK / VL; i++) vstore(strip + (n - n0) * K + b * QK + VL * i, wv[i]); \
                    }                                                                                       \
                strip_rows(x, M, K, strip, n1 - n0, y + n0, N);                                             \
            }                                                                                               \
        }                                                                                                   \
    }

DEFINE_QGEMM(q4)
DEFINE_QGEMM(q8)
