// y[M, N] = x[M, K] @ W[N, K]^T on Intel AMX (TDPBF16PS) for quantized weights in the tiled layouts q4t and q8t,
// float32 activations. Built only for the 'amx' ISA (AVX-512 + AVX512-BF16 + AMX-BF16), next to qgemm.c, ops.c and
// layers.c.
//
// Why it is the same model: the tile unit multiplies bfloat16 pairs exactly and accumulates in float32.
//   - a q4 weight's q (0..15) and a q8 weight's q (-128..127) are bfloat16 values exactly;
//   - every activation is split exactly into three bfloat16 parts, x = x1 + x2 + x3 (8 + 8 + 8 significant bits
//     cover float32's 24), so every product is exact in float32 and only the additions round, as in float32;
//   - per 32-weight block b and column n: s = (sum_k q x1 + sum_k q x2) + sum_k q x3, then
//     y += d[b,n] * s (+ m[b,n] * S[b] for q4, S[b] = sum_k x: the block's d * q + m, factored).
// Determinism: a row's three parts sit in three rows of one A tile and its result is computed from them alone, in
// a fixed order, whatever M is and whichever tile, chunk or thread it falls in: a row's output never depends on
// the batch (the contract of qgemm.c; tests/unit/kernels/test_qgemm.py checks it bitwise).
//
// Layouts (verispec/kernels/qweight.py builds them): output columns in groups of 16; group g, block b starts at
// ((g * K/32) + b) * TBLOCK. q4t (384 bytes): float d[16], float m[16], a nibble plane: 4 chunks of 32
// little-endian uint16 words; nibble t of word j of chunk c is the weight of B-tile row r = c + 4t, word j:
// column n = j / 2, k = 2r + j % 2 (the pair order TDPBF16PS reads). One 64-byte load, three shifts and four vpermw
// (a 32-entry table that ignores the bits above the nibble) expand it into its 16 x 32 bfloat16 tile.
// q8t (576 bytes): float d[16], then the 512 int8 weights in B-tile order (row r, word j as above), converted
// through float32 (exact).
//
// Speed: the tile store per block is the fixed cost (~15 cycles, whatever the rows), so a tile carries 5 rows x 3
// parts. Rows go in chunks of 10 (two A tiles) whose accumulators live in registers. The loop over blocks is
// software-pipelined: a tile load never reads B bytes that vector stores just wrote (block b + AHEAD is expanded
// while block b is multiplied), and the C tiles of block b are scaled after block b + 1's products are issued.
// Past PRE_ROWS rows an item's blocks are expanded once, up front, and reused by every chunk.
#include <immintrin.h>
#include <stdint.h>
#include "kernels.h"
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

#define QK 32
#define GROUP 16    // output columns per tile
#define A_ROWS 5    // activation rows per A tile (x 3 parts = 15 tile rows)
#define CHUNK 10    // rows per tile round: two A tiles
#define PRE_ROWS 20 // more rows than this: an item's B tiles are expanded once for all its row chunks
#define CTILE (3 * A_ROWS * GROUP)  // floats per stored C tile
#define AHEAD 2     // blocks expanded ahead of the one multiplied
#define RING 4      // B tile buffers per tile slot (> AHEAD)
// blocks of weights fetched ahead of the expansion (tuned on decode steps, where the weights come from memory, not
// cache)
#define PREFETCH(F) ((F) == Q4T ? 24 : 4)

// The two formats. An item is what one thread computes over all K: q4t two column groups (each its own B tile
// and C tile), q8t one group.
enum { Q4T = 0, Q8T = 1 };
#define TBLOCK(F) ((F) == Q4T ? 384 : 576)
#define ITEM_GROUPS(F) ((F) == Q4T ? 2 : 1)

#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18

// Linux hands out the tile state only on request: 1 if this process may use AMX.
int amx_init(void) { return syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0; }

typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} __attribute__((packed)) TileConfig;

// Tiles 0-1: A (up to 5 rows x 3 parts, 32 bf16 each); 2-3: B (16 pair rows, 16 columns x 2); 4-5: C of A tile 0,
// 6-7: C of A tile 1 (16 f32 each). rows0 / rows1: the rows of A tile 0 / 1 (M = 1 moves 3 rows, not 15).
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

// Row m of x -> its three bf16 parts in xs [Mpad, 3, K] (x1, x2, x3) and, if S, its per-block sums S [M, K/32].
static void split_row(const float *x, int64_t m, int64_t K, uint16_t *xs, float *S) {
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
    if (S)
        for (int64_t b = 0; b < K / QK; b++)
            S[m * (K / QK) + b] = hsum(_mm512_add_ps(_mm512_loadu_ps(xr + b * QK), _mm512_loadu_ps(xr + b * QK + 16)));
}

// One nibble plane -> its B tile [16 rows][32 bf16] in `bt` (64-byte aligned), each nibble looked up in `table`.
static inline void expand_plane(const uint8_t *nib, uint16_t *bt, __m512i table) {
    for (int c = 0; c < 4; c++) {
        const __m512i w = _mm512_loadu_si512(nib + 64 * c);
        _mm512_store_si512(bt + 32 * c, _mm512_permutexvar_epi16(w, table));
        _mm512_store_si512(bt + 32 * (c + 4), _mm512_permutexvar_epi16(_mm512_srli_epi16(w, 4), table));
        _mm512_store_si512(bt + 32 * (c + 8), _mm512_permutexvar_epi16(_mm512_srli_epi16(w, 8), table));
        _mm512_store_si512(bt + 32 * (c + 12), _mm512_permutexvar_epi16(_mm512_srli_epi16(w, 12), table));
    }
}

// One q8t block's int8 weights (B-tile order, 32 per row) -> its B tile of exact bfloat16 values.
static inline void expand_int8(const uint8_t *q, uint16_t *bt) {
    for (int r = 0; r < 16; r++) {
        const __m512 a = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(q + 32 * r))));
        const __m512 b = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(q + 32 * r + 16))));
        _mm512_store_si512(bt + 32 * r, (__m512i)_mm512_cvtne2ps_pbh(b, a));  // words 0-15: a, 16-31: b
    }
}

// The 32-entry vpermw table of expand_plane: word i = bf16(i % 16).
static __m512i nibble_table(void) {
    const __m512 q = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    return (__m512i)_mm512_cvtne2ps_pbh(q, q);
}

// Block b of an item -> its B tiles (q4t: bt[0], bt[1] for groups 0 and 1; q8t: bt[0]), prefetching ahead.
static inline __attribute__((always_inline)) void expand_item_block(const int F, const uint8_t *w0, int64_t nb,
                                                                    int ng, int64_t b, uint16_t (*bt)[16 * 32],
                                                                    __m512i table) {
    const uint8_t *blk = w0 + b * TBLOCK(F);
    for (int l = 0; l < TBLOCK(F); l += 64) _mm_prefetch((const char *)blk + PREFETCH(F) * TBLOCK(F) + l, _MM_HINT_T0);
    if (F == Q4T) {
        expand_plane(blk + 128, bt[0], table);
        if (ng == 2) {
            const uint8_t *blk1 = blk + nb * TBLOCK(F);
            for (int l = 0; l < TBLOCK(F); l += 64)
                _mm_prefetch((const char *)blk1 + PREFETCH(F) * TBLOCK(F) + l, _MM_HINT_T0);
            expand_plane(blk1 + 128, bt[1], table);
        }
    } else {
        expand_int8(blk + 64, bt[0]);
    }
}

// One chunk's products for one block, B tiles 2-3 loaded: A tiles from xs (a0: the chunk's first row, block b);
// C tiles stored to c[2a + j] (A tile a, column group j).
static inline __attribute__((always_inline)) void tile_round(const int F, const uint8_t *a0, int64_t a_stride,
                                                             int64_t rows, int ng, float (*c)[CTILE]) {
    _tile_loadd(0, a0, a_stride);
    _tile_zero(4);
    _tile_dpbf16ps(4, 0, 2);
    if (F == Q4T && ng == 2) {
        _tile_zero(5);
        _tile_dpbf16ps(5, 0, 3);
    }
    if (rows > A_ROWS) {
        _tile_loadd(1, a0 + 3 * A_ROWS * a_stride, a_stride);
        _tile_zero(6);
        _tile_dpbf16ps(6, 1, 2);
        if (F == Q4T && ng == 2) {
            _tile_zero(7);
            _tile_dpbf16ps(7, 1, 3);
        }
    }
    _tile_stored(4, c[0], 64);
    if (F == Q4T && ng == 2) _tile_stored(5, c[1], 64);
    if (rows > A_ROWS) {
        _tile_stored(6, c[2], 64);
        if (F == Q4T && ng == 2) _tile_stored(7, c[3], 64);
    }
}

// acc += d_j * s (+ m_j * S) for row i, column group j of one chunk's C tiles; `blk`: the item's block (group 0).
static inline __attribute__((always_inline)) __m512 scale_one(const int F, const float (*c)[CTILE], int i, int j,
                                                              const uint8_t *blk, int64_t nb, const float *S,
                                                              __m512 acc) {
    const float *t = c[2 * (i / A_ROWS) + j] + 3 * (i % A_ROWS) * GROUP;
    const __m512 s = _mm512_add_ps(_mm512_add_ps(_mm512_load_ps(t), _mm512_load_ps(t + GROUP)),
                                   _mm512_load_ps(t + 2 * GROUP));
    const uint8_t *g = blk + j * nb * TBLOCK(F);
    acc = _mm512_fmadd_ps(s, _mm512_loadu_ps((const float *)g), acc);
    if (F == Q4T) acc = _mm512_fmadd_ps(_mm512_set1_ps(S[i * nb]), _mm512_loadu_ps((const float *)(g + 64)), acc);
    return acc;
}

// One item for R <= CHUNK rows (R a constant at each call), accumulators in registers. The B tiles come from
// `pre` (all K/32 blocks expanded beforehand: [nb][2][16 * 32]) or, if NULL, are expanded on the way (ring bt).
static inline __attribute__((always_inline)) void item_rows(const int F, const int R, const uint16_t *xs,
                                                            const float *S, int64_t K, const uint8_t *w0, int ng,
                                                            const uint16_t *pre, uint16_t (*bt)[2][16 * 32],
                                                            float (*cbuf)[4][CTILE], __m512i table, float *y, int64_t N) {
    const int64_t nb = K / QK, a_stride = K * (int64_t)sizeof(uint16_t);
    __m512 acc[CHUNK][2];
#pragma GCC unroll 10
    for (int i = 0; i < R; i++) acc[i][0] = acc[i][1] = _mm512_setzero_ps();
    const int ahead = pre ? 0 : AHEAD;
    for (int64_t b = 0; b <= nb + ahead; b++) {
        if (!pre && b < nb) expand_item_block(F, w0, nb, ng, b, bt[b % RING], table);
        const int64_t u = b - ahead;  // the block multiplied now; u - 1 is scaled
        if (u >= 0 && u < nb) {
            const uint16_t *b0 = pre ? pre + u * 2 * 16 * 32 : bt[u % RING][0];
            _tile_loadd(2, b0, 64);
            if (F == Q4T && ng == 2) _tile_loadd(3, b0 + 16 * 32, 64);
            tile_round(F, (const uint8_t *)(xs + u * QK), a_stride, R, ng, cbuf[u % 2]);
        }
        if (u >= 1) {
            const float(*c)[CTILE] = (const float(*)[CTILE])cbuf[(u - 1) % 2];
            const uint8_t *blk = w0 + (u - 1) * TBLOCK(F);
#pragma GCC unroll 10
            for (int i = 0; i < R; i++) {
                acc[i][0] = scale_one(F, c, i, 0, blk, nb, S + u - 1, acc[i][0]);
                if (F == Q4T && ng == 2) acc[i][1] = scale_one(F, c, i, 1, blk, nb, S + u - 1, acc[i][1]);
            }
        }
    }
#pragma GCC unroll 10
    for (int i = 0; i < R; i++) {
        _mm512_storeu_ps(y + i * N, acc[i][0]);
        if (F == Q4T && ng == 2) _mm512_storeu_ps(y + i * N + GROUP, acc[i][1]);
    }
}

#define ROWS_CASE(F, R) \
    case R:             \
        item_rows(F, R, xc, Sc, K, w0, ng, pre, bt, cbuf, table, yc, N); \
        break;

// The calling thread's scratch (activation parts and block sums), grown on demand and kept: a decode step makes
// ~150 kernel calls and none of them allocates. A pass has at most MAX_ROWS rows, so it stays a few MB.
static void *caller_scratch(size_t bytes) {
    static __thread void *buf;
    static __thread size_t cap;
    if (bytes > cap) {
        free(buf);
        cap = (bytes + 4095) / 4096 * 4096;
        buf = aligned_alloc(64, cap);
    }
    return buf;
}

static inline __attribute__((always_inline)) void qgemm_tiled(const int F, const float *x, int64_t M, int64_t K,
                                                              const uint8_t *w, int64_t N, float *y, int nthreads) {
    // up to 10 rows: tiles of exactly their rows; more: chunks of 10, the last one padded with zero rows
    const int64_t nb = K / QK, groups = N / GROUP, Mpad = M <= CHUNK ? M : (M + CHUNK - 1) / CHUNK * CHUNK;
    const int rows0 = 3 * (int)(Mpad < A_ROWS ? Mpad : A_ROWS);
    const int rows1 = 3 * (int)(Mpad < CHUNK ? (Mpad > A_ROWS ? Mpad - A_ROWS : 0) : A_ROWS);
    const size_t xs_bytes = (size_t)((Mpad * 3 * K * (int64_t)sizeof(uint16_t) + 63) / 64 * 64);
    uint16_t *xs = caller_scratch(xs_bytes + (size_t)(M * nb) * sizeof(float));
    float *S = F == Q4T ? (float *)((uint8_t *)xs + xs_bytes) : NULL;
    memset(xs + M * 3 * K, 0, (size_t)(Mpad - M) * 3 * K * sizeof(uint16_t));  // padding rows of the last chunk
    const int64_t items = (groups + ITEM_GROUPS(F) - 1) / ITEM_GROUPS(F);
    const __m512i table = nibble_table();
#pragma omp parallel num_threads(nthreads)
    {
        // the rows are split by all threads (implicit barrier), then every thread reads every row's parts
#pragma omp for schedule(static)
        for (int64_t m = 0; m < M; m++) split_row(x, m, K, xs, S);
        configure_tiles(rows0, rows1);
        uint16_t bt[RING][2][16 * 32] __attribute__((aligned(64)));
        float cbuf[2][4][CTILE] __attribute__((aligned(64)));
        // more than PRE_ROWS rows: every block of an item is expanded once, then multiplied chunk by chunk (fewer
        // rows: each chunk expands on the way, which pipelines better)
        uint16_t *pre = M > PRE_ROWS ? aligned_alloc(64, (size_t)nb * 2 * 16 * 32 * sizeof(uint16_t)) : NULL;
#pragma omp for schedule(static)
        for (int64_t it = 0; it < items; it++) {
            const int64_t g0 = ITEM_GROUPS(F) * it;
            const int ng = groups - g0 >= ITEM_GROUPS(F) ? ITEM_GROUPS(F) : 1;
            const uint8_t *w0 = w + g0 * nb * TBLOCK(F);
            if (pre)
                for (int64_t b = 0; b < nb; b++)
                    expand_item_block(F, w0, nb, ng, b, (uint16_t(*)[16 * 32])(pre + b * 2 * 16 * 32), table);
            for (int64_t m0 = 0; m0 < M; m0 += CHUNK) {
                const uint16_t *xc = xs + m0 * 3 * K;
                const float *Sc = S ? S + m0 * nb : NULL;
                float *yc = y + m0 * N + g0 * GROUP;
                switch (M - m0 < CHUNK ? M - m0 : CHUNK) {
                    ROWS_CASE(F, 1) ROWS_CASE(F, 2) ROWS_CASE(F, 3) ROWS_CASE(F, 4) ROWS_CASE(F, 5)
                    ROWS_CASE(F, 6) ROWS_CASE(F, 7) ROWS_CASE(F, 8) ROWS_CASE(F, 9) ROWS_CASE(F, 10)
                }
            }
        }
        _tile_release();
        free(pre);
    }
}

// Entry points (ctypes): x [M, K] float32, w in the q4t / q8t layout (N a multiple of 16, K of 32), y [M, N].
// Long prompts go MAX_ROWS rows per pass: the bf16 parts of a pass stay small (~2 MB at K = 1536) whatever M is,
// and a row's result does not depend on the pass it is in.
#define MAX_ROWS 320
void qgemm_q4t(const float *x, int64_t M, int64_t K, const uint8_t *w, int64_t N, float *y, int nthreads) {
    for (int64_t m0 = 0; m0 < M; m0 += MAX_ROWS)
        qgemm_tiled(Q4T, x + m0 * K, M - m0 < MAX_ROWS ? M - m0 : MAX_ROWS, K, w, N, y + m0 * N, nthreads);
}

void qgemm_q8t(const float *x, int64_t M, int64_t K, const uint8_t *w, int64_t N, float *y, int nthreads) {
    for (int64_t m0 = 0; m0 < M; m0 += MAX_ROWS)
        qgemm_tiled(Q8T, x + m0 * K, M - m0 < MAX_ROWS ? M - m0 : MAX_ROWS, K, w, N, y + m0 * N, nthreads);
}
