// y[M, N] = x[M, K] @ W[N, K]^T on Intel AMX (TDPBF16PS), 4-bit weights in the q4t layout, float32 activations.
// Built only for the 'amx' ISA (AVX-512 + AVX512-BF16 + AMX-BF16), next to qgemm.c, ops.c and layers.c.
//
// Why it is exact enough to be the same model: the tile unit multiplies bfloat16 pairs and accumulates in float32.
//   - every weight's 4-bit q (0..15) is a bfloat16 exactly;
//   - every activation is split exactly into three bfloat16 parts, x = x1 + x2 + x3 (8 + 8 + 8 significant bits
//     cover float32's 24), so each product q * x_i is exact in float32 and only the additions round, as in float32;
//   - per 32-weight block b and column n: s = (sum_k q x1 + sum_k q x2) + sum_k q x3, then
//     y += d[b,n] * s; y += m[b,n] * S[b]  with S[b] = sum_k x (the block's d * q + m, factored).
// Determinism: a row's three parts sit in three rows of one A tile and its result is computed from them alone, in
// a fixed order, whatever M is and whichever tile, chunk or thread it falls in: a row's output never depends on
// the batch (the same contract as qgemm.c; tests/unit/test_qgemm.py checks it bitwise).
//
// q4t layout (verispec/kernels/qweight.py builds it): columns in groups of 16; group g, block b is 384 bytes at
// ((g * K/32) + b) * 384: float d[16], float m[16], then 4 chunks of 32 little-endian uint16 words. Nibble t of word
// j of chunk c is the weight of B-tile row r = c + 4t, word j: column n = j / 2, k = 2r + j % 2 (the VNNI pair
// order TDPBF16PS reads). One 64-byte load, three shifts and four vpermw (a 32-entry table that ignores the bits
// above the nibble) expand a block into its 16 x 32 bfloat16 tile.
#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

#define QK 32
#define GROUP 16      // output columns per tile
#define TBLOCK 384    // bytes per (group, block)
#define A_ROWS 5      // activation rows per A tile (x 3 parts = 15 tile rows)
#define CHUNK 10      // rows per TDP round: two A tiles
#define SUPER 20      // rows whose accumulators stay in L1 while a column pair sweeps K
#define CTILE (3 * A_ROWS * GROUP)  // floats per stored C tile
#define AHEAD 2       // blocks expanded ahead of the one multiplied
#define RING 4        // B tile buffers per column group (> AHEAD)
#define PREFETCH 8    // blocks of weights fetched ahead of the expansion

#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18

// Linux hands out the tile state only on request: 1 if this process may use AMX.
int amx_init(void) { return syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0; }

typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} __attribute__((packed)) TileConfig;

// Tiles 0-1: A (5 rows x 3 parts, 32 bf16 each); 2-3: B (16 pair rows, 16 columns x 2); 4-7: C (A's rows x 16 f32).
// rows0 / rows1: tile rows of A tile 0 / 1 and their C tiles (fewer rows, fewer bytes moved: M = 1 uses 3).
static void configure_tiles(int rows0, int rows1) {
    TileConfig c;
    memset(&c, 0, sizeof c);
    c.palette = 1;
    const int rows[8] = {rows0, rows1, 16, 16, rows0, rows0, rows1, rows1};
    for (int t = 0; t < 8; t++) {
        c.rows[t] = (uint8_t)rows[t];
        c.colsb[t] = rows[t] ? 64 : 0;
    }
    _tile_loadconfig(&c);
}

static inline float hsum(__m512 v) {
    const __m256 h = _mm256_add_ps(_mm512_castps512_ps256(v), _mm512_extractf32x8_ps(v, 1));
    const __m128 s = _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
    const __m128 t = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(t, _mm_movehdup_ps(t)));
}

static inline __m512 bf16_to_f32(__m256bh h) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32((__m256i)h), 16));
}

// xs [Mpad, 3, K] bf16: row m's parts x1, x2, x3 (rows M..Mpad-1 zero); S [M, K/32]: per-block sums of x.
static void split_rows(const float *x, int64_t M, int64_t Mpad, int64_t K, uint16_t *xs, float *S) {
    memset(xs + M * 3 * K, 0, (size_t)(Mpad - M) * 3 * K * sizeof(uint16_t));
    for (int64_t m = 0; m < M; m++) {
        const float *xr = x + m * K;
        uint16_t *p = xs + m * 3 * K;
        for (int64_t k = 0; k < K; k += 16) {
            const __m512 v = _mm512_loadu_ps(xr + k);
            const __m256bh h1 = _mm512_cvtneps_pbh(v);
            const __m512 r1 = _mm512_sub_ps(v, bf16_to_f32(h1));  // exact
            const __m256bh h2 = _mm512_cvtneps_pbh(r1);
            const __m256bh h3 = _mm512_cvtneps_pbh(_mm512_sub_ps(r1, bf16_to_f32(h2)));  // exact, fits 8 bits
            _mm256_storeu_si256((__m256i *)(p + k), (__m256i)h1);
            _mm256_storeu_si256((__m256i *)(p + K + k), (__m256i)h2);
            _mm256_storeu_si256((__m256i *)(p + 2 * K + k), (__m256i)h3);
        }
        for (int64_t b = 0; b < K / QK; b++)
            S[m * (K / QK) + b] = hsum(_mm512_add_ps(_mm512_loadu_ps(xr + b * QK), _mm512_loadu_ps(xr + b * QK + 16)));
    }
}

// One (group, block)'s nibbles -> its B tile [16 rows][32 bf16] in `bt` (64-byte aligned).
static inline void expand_block(const uint8_t *nib, uint16_t *bt, __m512i table) {
    for (int c = 0; c < 4; c++) {
        const __m512i w = _mm512_loadu_si512(nib + 64 * c);
        _mm512_store_si512(bt + 32 * c, _mm512_permutexvar_epi16(w, table));
        _mm512_store_si512(bt + 32 * (c + 4), _mm512_permutexvar_epi16(_mm512_srli_epi16(w, 4), table));
        _mm512_store_si512(bt + 32 * (c + 8), _mm512_permutexvar_epi16(_mm512_srli_epi16(w, 8), table));
        _mm512_store_si512(bt + 32 * (c + 12), _mm512_permutexvar_epi16(_mm512_srli_epi16(w, 12), table));
    }
}

// acc[i, 16j..16j+15] += d_j * s + m_j * S for the rows of one chunk; its C tiles (a, j) are c[2a + j].
static inline void scale_rows(const float (*c)[CTILE], int64_t rows, int ng, const uint8_t *blk0, const uint8_t *blk1,
                              const float *S, int64_t nb, float *acc) {
    for (int64_t i = 0; i < rows; i++) {
        const int a = (int)(i / A_ROWS), r = (int)(i % A_ROWS);
        const __m512 sx = _mm512_set1_ps(S[i * nb]);
        for (int j = 0; j < ng; j++) {
            const uint8_t *blk = j ? blk1 : blk0;
            const float *t = c[2 * a + j] + 3 * r * GROUP;
            const __m512 s = _mm512_add_ps(_mm512_add_ps(_mm512_load_ps(t), _mm512_load_ps(t + GROUP)),
                                           _mm512_load_ps(t + 2 * GROUP));
            __m512 y = _mm512_load_ps(acc + i * 2 * GROUP + j * GROUP);
            y = _mm512_fmadd_ps(s, _mm512_loadu_ps((const float *)blk), y);
            y = _mm512_fmadd_ps(sx, _mm512_loadu_ps((const float *)(blk + 64)), y);
            _mm512_store_ps(acc + i * 2 * GROUP + j * GROUP, y);
        }
    }
}

// One chunk's products for one block: A tiles from xs, B tiles 2 (and 3) already loaded; C tiles stored to c.
static inline void tile_round(const uint8_t *a0, int64_t a_stride, int64_t rows, int ng, float (*c)[CTILE]) {
    _tile_loadd(0, a0, a_stride);
    _tile_zero(4);
    _tile_dpbf16ps(4, 0, 2);
    if (ng == 2) {
        _tile_zero(5);
        _tile_dpbf16ps(5, 0, 3);
    }
    if (rows > A_ROWS) {
        _tile_loadd(1, a0 + 3 * A_ROWS * a_stride, a_stride);
        _tile_zero(6);
        _tile_dpbf16ps(6, 1, 2);
        if (ng == 2) {
            _tile_zero(7);
            _tile_dpbf16ps(7, 1, 3);
        }
    }
    _tile_stored(4, c[0], 64);
    if (ng == 2) _tile_stored(5, c[1], 64);
    if (rows > A_ROWS) {
        _tile_stored(6, c[2], 64);
        if (ng == 2) _tile_stored(7, c[3], 64);
    }
}

// scale_rows with the accumulators in registers: acc[i][j] for row i, column group j (R a constant at each call).
static inline __attribute__((always_inline)) void scale_regs(const int R, const float (*c)[CTILE], int ng,
                                                             const uint8_t *blk0, const uint8_t *blk1,
                                                             const float *S, int64_t nb, __m512 acc[CHUNK][2]) {
#pragma GCC unroll 10
    for (int i = 0; i < R; i++) {
        const int a = i / A_ROWS, r = i % A_ROWS;
        const __m512 sx = _mm512_set1_ps(S[i * nb]);
#pragma GCC unroll 2
        for (int j = 0; j < 2; j++) {
            if (j == 1 && ng == 1) break;
            const uint8_t *blk = j ? blk1 : blk0;
            const float *t = c[2 * a + j] + 3 * r * GROUP;
            const __m512 s = _mm512_add_ps(_mm512_add_ps(_mm512_load_ps(t), _mm512_load_ps(t + GROUP)),
                                           _mm512_load_ps(t + 2 * GROUP));
            acc[i][j] = _mm512_fmadd_ps(s, _mm512_loadu_ps((const float *)blk), acc[i][j]);
            acc[i][j] = _mm512_fmadd_ps(sx, _mm512_loadu_ps((const float *)(blk + 64)), acc[i][j]);
        }
    }
}

// One column pair for M = R <= CHUNK rows: the same operations as the general path, accumulators in registers.
static inline __attribute__((always_inline)) void pair_small(const int R, const uint16_t *xs, const float *S,
                                                             int64_t K, const uint8_t *w0, int ng,
                                                             uint16_t (*bt)[2][16 * 32], float (*cbuf)[4][CTILE],
                                                             __m512i table, float *y, int64_t N) {
    const int64_t nb = K / QK, a_stride = K * (int64_t)sizeof(uint16_t);
    const uint8_t *w1 = w0 + nb * TBLOCK;
    __m512 acc[CHUNK][2];
#pragma GCC unroll 10
    for (int i = 0; i < R; i++) acc[i][0] = acc[i][1] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nb + AHEAD; b++) {
        if (b < nb)
            for (int j = 0; j < ng; j++) {
                const uint8_t *blk = (j ? w1 : w0) + b * TBLOCK;
                for (int l = 0; l < TBLOCK; l += 64)
                    _mm_prefetch((const char *)blk + PREFETCH * TBLOCK + l, _MM_HINT_T0);
                expand_block(blk + 128, bt[b % RING][j], table);
            }
        const int64_t u = b - AHEAD;
        if (u >= 0) {
            _tile_loadd(2, bt[u % RING][0], 64);
            if (ng == 2) _tile_loadd(3, bt[u % RING][1], 64);
            tile_round((const uint8_t *)(xs + u * QK), a_stride, R, ng, cbuf[u % 2]);
        }
        if (u >= 1)
            scale_regs(R, (const float (*)[CTILE])cbuf[(u - 1) % 2], ng, w0 + (u - 1) * TBLOCK,
                       w1 + (u - 1) * TBLOCK, S + u - 1, nb, acc);
    }
    scale_regs(R, (const float (*)[CTILE])cbuf[(nb - 1) % 2], ng, w0 + (nb - 1) * TBLOCK, w1 + (nb - 1) * TBLOCK,
               S + nb - 1, nb, acc);
#pragma GCC unroll 10
    for (int i = 0; i < R; i++) {
        _mm512_storeu_ps(y + i * N, acc[i][0]);
        if (ng == 2) _mm512_storeu_ps(y + i * N + GROUP, acc[i][1]);
    }
}

#define PAIR_SMALL_CASE(R) \
    case R:                \
        pair_small(R, xs, S, K, w0, ng, bt, (float (*)[4][CTILE])cbuf, table, y + g0 * GROUP, N); \
        break;

// Entry point (ctypes): x [M, K] float32, w in the q4t layout (N a multiple of 16, K of 32), y [M, N] float32.
// Software-pipelined over blocks: a tile load never reads the B tile vector stores just wrote (block b + AHEAD is
// expanded while block b is multiplied), and the C tiles of block b are scaled after block b + 1's products are
// issued (a tile store and the vector loads of the same bytes back to back stall for hundreds of cycles).
void qgemm_q4t(const float *x, int64_t M, int64_t K, const uint8_t *w, int64_t N, float *y, int nthreads) {
    // up to 10 rows: tiles of exactly their rows; more: chunks of 10, the last one padded with zero rows
    const int64_t nb = K / QK, groups = N / GROUP, Mpad = M <= CHUNK ? M : (M + CHUNK - 1) / CHUNK * CHUNK;
    const int rows0 = 3 * (int)(Mpad < A_ROWS ? Mpad : A_ROWS);
    const int rows1 = 3 * (int)(Mpad < CHUNK ? (Mpad > A_ROWS ? Mpad - A_ROWS : 0) : A_ROWS);
    const int64_t xs_bytes = (Mpad * 3 * K * (int64_t)sizeof(uint16_t) + 63) / 64 * 64;
    uint16_t *xs = aligned_alloc(64, (size_t)xs_bytes);
    float *S = malloc((size_t)(M * nb) * sizeof(float));
    split_rows(x, M, Mpad, K, xs, S);
    const int64_t items = (groups + 1) / 2, a_stride = K * (int64_t)sizeof(uint16_t);  // A row = (row, part)
    const __m512i table = (__m512i)_mm512_cvtne2ps_pbh(
        _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
        _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15));  // word i = bf16(i % 16)
#pragma omp parallel num_threads(nthreads)
    {
        configure_tiles(rows0, rows1);
        uint16_t bt[RING][2][16 * 32] __attribute__((aligned(64)));
        float cbuf[2][SUPER / CHUNK][4][CTILE] __attribute__((aligned(64)));
        float acc[SUPER * 2 * GROUP] __attribute__((aligned(64)));
#pragma omp for schedule(static)
        for (int64_t it = 0; it < items; it++) {
            const int64_t g0 = 2 * it;
            const int ng = groups - g0 >= 2 ? 2 : 1;
            const uint8_t *w0 = w + g0 * nb * TBLOCK, *w1 = w0 + nb * TBLOCK;
            if (M <= CHUNK) {
                switch (M) {
                    PAIR_SMALL_CASE(1) PAIR_SMALL_CASE(2) PAIR_SMALL_CASE(3) PAIR_SMALL_CASE(4) PAIR_SMALL_CASE(5)
                    PAIR_SMALL_CASE(6) PAIR_SMALL_CASE(7) PAIR_SMALL_CASE(8) PAIR_SMALL_CASE(9) PAIR_SMALL_CASE(10)
                }
                continue;
            }
            for (int64_t m0 = 0; m0 < M; m0 += SUPER) {
                const int64_t m1 = M < m0 + SUPER ? M : m0 + SUPER;
                memset(acc, 0, sizeof acc);
                for (int64_t b = 0; b < nb + AHEAD; b++) {
                    if (b < nb)
                        for (int j = 0; j < ng; j++) {
                            const uint8_t *blk = (j ? w1 : w0) + b * TBLOCK;
                            for (int l = 0; l < TBLOCK; l += 64)  // the weights PREFETCH blocks ahead
                                _mm_prefetch((const char *)blk + PREFETCH * TBLOCK + l, _MM_HINT_T0);
                            expand_block(blk + 128, bt[b % RING][j], table);
                        }
                    const int64_t u = b - AHEAD;  // the block multiplied now
                    if (u >= 0) {
                        _tile_loadd(2, bt[u % RING][0], 64);
                        if (ng == 2) _tile_loadd(3, bt[u % RING][1], 64);
                        for (int64_t c = m0; c < m1; c += CHUNK)
                            tile_round((const uint8_t *)(xs + c * 3 * K + u * QK), a_stride,
                                       m1 - c < CHUNK ? m1 - c : CHUNK, ng, cbuf[u % 2][(c - m0) / CHUNK]);
                    }
                    if (u >= 1)
                        for (int64_t c = m0; c < m1; c += CHUNK)
                            scale_rows(cbuf[(u - 1) % 2][(c - m0) / CHUNK], m1 - c < CHUNK ? m1 - c : CHUNK, ng,
                                       w0 + (u - 1) * TBLOCK, w1 + (u - 1) * TBLOCK, S + c * nb + u - 1, nb,
                                       acc + (c - m0) * 2 * GROUP);
                }
                for (int64_t c = m0; c < m1; c += CHUNK)  // the last block
                    scale_rows(cbuf[(nb - 1) % 2][(c - m0) / CHUNK], m1 - c < CHUNK ? m1 - c : CHUNK, ng,
                               w0 + (nb - 1) * TBLOCK, w1 + (nb - 1) * TBLOCK, S + c * nb + nb - 1, nb,
                               acc + (c - m0) * 2 * GROUP);
                for (int64_t m = m0; m < m1; m++)
                    memcpy(y + m * N + g0 * GROUP, acc + (m - m0) * 2 * GROUP, (size_t)ng * GROUP * sizeof(float));
            }
        }
        _tile_release();
    }
    free(xs);
    free(S);
}
