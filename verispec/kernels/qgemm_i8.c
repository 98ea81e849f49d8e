// y[M, N] = x[M, K] @ W[N, K]^T with the activations quantized to int8 (activation_dtype="int8": llama.cpp's
// numerics) and integer dot products: AVX-VNNI (256-bit vpdpbusd), AVX512-VNNI (512-bit), AMX-INT8 (tdpbssd) or,
// on CPUs with none of them, AVX2 (vpmaddubsw + vpmaddwd).
// Every variant is compiled into every x86-64 build inside its own `#pragma GCC target` region; the caller picks one
// by the CPU's flags (verispec/kernels/build.py: int8_isa).
//
// Activations: each row on its own, in blocks of 32, as llama.cpp's quantize_row_q8_0 does on x86 but with a float32
// scale: d = max|x| / 127, q = round-half-even(x * (127 / max|x|)) in -127..127 (q = 0 where max|x| = 0), kept with
// d, d * sum(q), 128 * sum(q) and 32 * the sums of its two halves (q 0-15, 16-31). A row's quantization never looks
// at another row.
//
// Weights (verispec/kernels/qweight.py makes them from q4 / q8 / q4t / q8t): output columns in groups of 16, group
// g and block b at ((g * K/32) + b) * TB; inside, 8 rows of 64 bytes, row j holding for column n (bytes 4n..4n+3)
// the weights k = 4j..4j+3 (the B-tile layout of AMX-INT8, and 16 columns of vpdpbusd at once):
//   q4v (384 bytes): float d[16], float m[16], then 4 rows of 64 bytes whose low nibbles are rows 0-3 and high
//       nibbles rows 4-7 (weight = d * q + m, q in 0..15);
//   q8v (576 bytes): float d[16], then the 8 rows as uint8 q + 128 (weight = d * q, q in -128..127);
//   q6v (640 bytes): float d0[16], float d1[16], then the 8 rows as uint8 q + 32 (Q6_K: weight k = d_(k/16) * q,
//       q in -32..31; rows 0-3 hold k = 0..15, rows 4-7 k = 16..31).
// and, for Q4_K / Q6_K weights whose scales factor (repack.c: int8_compact), per group and super-block of 8 blocks
// a 320-byte record, then the blocks (K a multiple of 256):
//   q4kv (2368 bytes): float16 d[16], float16 m[16], uint8 scale[8][16], uint8 min[8][16], then per block q4v's 4
//       rows (d_w = d * scale[b % 8], m_w = m * min[b % 8]: q4v's floats, exactly);
//   q6kv (3392 bytes): float16 d[16], int8 scale[16][16] (half h of block b: row 2 (b % 8) + h), 32 bytes of
//       padding, then per block 384 bytes: 4 rows of 64 whose low nibbles hold the low 4 bits of q + 32 for rows
//       0-3 and high nibbles for rows 4-7, then 2 rows of 64 with their high 2 bits (rows 0-3, rows 4-7; row j in
//       bits 2 (j % 4)..) (d_h = d * scale: q6v's floats, exactly). 4.6 and 6.6 bits a weight against 6 and 10.
// and, for q8 weights whose q lie in -16..15 and d is a float16 (Q5_0's), per group and pair of blocks (K a
// multiple of 64; 5.5 bits a weight against 9):
//   q5v (704 bytes): each block's 4 rows of 64 (low 4 bits of q + 16: rows 0-3 in the low nibbles, 4-7 in the
//       high ones), then each block's 64 bytes of 5th bits (bit j: row j's), then each block's float16 d[16]
//       (dot = sum((q + 16) q_x) - 16 sum(q_x): q8v's integer, and q8v's floats).
// Per block: dot = sum(q_w * q_x) exactly in int32 (q8v: sum((q_w + 128) q_x) - 128 sum(q_x)), then per column
//   acc = fma(float(dot), d_w * d_x, acc); q4v: acc = fma(m_w, d_x * sum(q_x), acc)
// q6v, per half h = 0, 1 of the block (dot_h = sum over its 16 k of (q_w + 32) q_x, minus 32 * sum(q_x)):
//   acc = fma(float(dot_0), d0_w * d_x, acc); acc = fma(float(dot_1), d1_w * d_x, acc)
// over the blocks in order. Every variant computes exactly that, so they are bitwise equal to each other, and a
// row's result never depends on the other rows, the tile it falls in or the number of threads (plain and
// speculative decoding stay identical).
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <immintrin.h>

#include "kernels.h"

#define QK 32
#define GROUP 16
#define TILE_M 32     // rows swept together over a thread's columns (up to 32 rows read the weights once)
#define COL_GROUPS 4  // column groups whose weights stay in L1 while TILE_M rows pass
#define PF_BLOCKS 4   // blocks ahead whose weights the VNNI kernels prefetch (decode steps read them from memory)
enum { Q4V = 0, Q8V = 1, Q6V = 2, Q4KV = 3, Q6KV = 4, Q5V = 5 };
enum { ISA_AVXVNNI = 1, ISA_AVX512VNNI = 2, ISA_AMX = 3, ISA_AVX2 = 4 };
// bytes per column group and block (q4kv / q6kv: on average; their super-block records are SB(F) bytes)
#define TB(F) ((F) == Q4V ? 384 : (F) == Q8V ? 576 : (F) == Q6V ? 640 : (F) == Q4KV ? 296 : (F) == Q6KV ? 424 : 352)
#define SB(F) ((F) == Q4KV ? 2368 : (F) == Q6KV ? 3392 : 704)
// a column group's (at wg) record of block b's super-block (q5v: pair of blocks)
#define SB_REC(F, wg, b) ((wg) + ((b) >> ((F) == Q5V ? 1 : 3)) * SB(F))
// where a block's 8 weight rows start (after its scales)
#define WROWS(F) ((F) == Q8V ? 64 : 128)

// One quantized row: K int8, then float d [K/32], float d * sum(q) [K/32], int32 128 * sum(q) [K/32], int32 32 *
// sum(q of k 0-15) [K/32], int32 32 * sum(q of k 16-31) [K/32].
#define ROW_BYTES(K) ((K) + 20 * ((K) / QK))
#define XD(row, K) ((const float *)((row) + (K)))
#define XSUM(row, K) ((const float *)((row) + (K)) + (K) / QK)
#define XC(row, K) ((const int32_t *)((row) + (K)) + 2 * ((K) / QK))
#define XH0(row, K) ((const int32_t *)((row) + (K)) + 3 * ((K) / QK))
#define XH1(row, K) ((const int32_t *)((row) + (K)) + 4 * ((K) / QK))

// A thread's scratch buffers, grown on demand and kept (no allocation per call): SCRATCH_ROWS holds the calling
// thread's quantized rows, SCRATCH_BTILES each AMX thread's B tiles of one column group, SCRATCH_SCALES their
// float scales (compact layouts), SCRATCH_ATILES the calling thread's quantized rows in AMX row-tile order.
enum { SCRATCH_ROWS = 0, SCRATCH_BTILES = 1, SCRATCH_SCALES = 2, SCRATCH_ATILES = 3 };
static uint8_t *thread_scratch(int which, size_t bytes) {
    static __thread void *buf[4];
    static __thread size_t cap[4];
    if (bytes > cap[which]) {
        free(buf[which]);
        cap[which] = (bytes + 4095) / 4096 * 4096;
        buf[which] = aligned_alloc(64, cap[which]);
    }
    return buf[which];
}

#pragma GCC push_options
#pragma GCC target("avx2,fma")
// Row x [K] -> its int8 blocks (layout above). AVX2 only (every variant's CPU has it), one code for all.
static void quantize_row(const float *x, int64_t K, uint8_t *out) {
    const int64_t nb = K / QK;
    float *d = (float *)(out + K), *s = d + nb;
    int32_t *c = (int32_t *)(s + nb), *h0 = c + nb, *h1 = h0 + nb;
    const __m256 sign = _mm256_set1_ps(-0.0f);
    const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
    for (int64_t b = 0; b < nb; b++) {
        __m256 v[4];
        __m256 amax = _mm256_setzero_ps();
        for (int i = 0; i < 4; i++) {
            v[i] = _mm256_loadu_ps(x + b * QK + 8 * i);
            amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign, v[i]));
        }
        __m128 m = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
        m = _mm_max_ps(m, _mm_movehl_ps(m, m));
        m = _mm_max_ss(m, _mm_movehdup_ps(m));
        // llama.cpp's quantize_row_q8_0 (x86): the scale 127 / max, not 1 / d (they differ in the last bit)
        const float mx = _mm_cvtss_f32(m), dd = mx / 127.0f, id = mx != 0.0f ? 127.0f / mx : 0.0f;
        __m256i q[4];
        for (int i = 0; i < 4; i++) q[i] = _mm256_cvtps_epi32(_mm256_mul_ps(v[i], _mm256_set1_ps(id)));
        // the sums of the two halves (q 0-15, 16-31): lanes 0-3 and 4-7 of one 8-lane reduction
        const __m256i lo = _mm256_add_epi32(q[0], q[1]), hi = _mm256_add_epi32(q[2], q[3]);
        __m256i s8 = _mm256_permute2x128_si256(lo, hi, 0x20);
        s8 = _mm256_add_epi32(s8, _mm256_permute2x128_si256(lo, hi, 0x31));
        s8 = _mm256_add_epi32(s8, _mm256_shuffle_epi32(s8, _MM_SHUFFLE(1, 0, 3, 2)));
        s8 = _mm256_add_epi32(s8, _mm256_shuffle_epi32(s8, _MM_SHUFFLE(2, 3, 0, 1)));
        const int32_t half0 = _mm256_cvtsi256_si32(s8), half1 = _mm256_extract_epi32(s8, 4);
        const int32_t total = half0 + half1;
        // packs interleave 128-bit lanes; the permutation puts the 32 bytes back in order
        const __m256i p = _mm256_packs_epi16(_mm256_packs_epi32(q[0], q[1]), _mm256_packs_epi32(q[2], q[3]));
        _mm256_storeu_si256((__m256i *)(out + b * QK), _mm256_permutevar8x32_epi32(p, order));
        d[b] = dd;
        s[b] = dd * (float)total;
        c[b] = 128 * total;
        h0[b] = 32 * half0;
        h1[b] = 32 * half1;
    }
}
#pragma GCC pop_options

void quantize_rows_i8(const float *x, int64_t M, int64_t K, uint8_t *out, int nthreads) {
#pragma omp parallel for num_threads(nthreads) schedule(static)
    for (int64_t m = 0; m < M; m++) quantize_row(x + m * K, K, out + m * ROW_BYTES(K));
}

// ---- AVX512-VNNI: 16 columns per zmm, up to 5 rows x 4 vectors per tile (32 registers) ----
#pragma GCC push_options
#pragma GCC target("avx2,fma,avx512f,avx512bw,avx512vl,avx512vnni")
#define PFX(name) avx512vnni_##name
#define VW 16
#define vi __m512i
#define vf __m512
#define VZERO_I() _mm512_setzero_si512()
#define VSET1_I(v) _mm512_set1_epi32(v)
#define VSET1_F(v) _mm512_set1_ps(v)
#define VLOAD_I(p) _mm512_loadu_si512((const void *)(p))
#define VLOAD_F(p) _mm512_loadu_ps(p)
#define VSTORE_F(p, v) _mm512_storeu_ps(p, v)
#define VAND(a, b) _mm512_and_si512(a, b)
#define VSRL16(a, n) _mm512_srli_epi16(a, n)
#define VSLL16(a, n) _mm512_slli_epi16(a, n)
#define VOR(a, b) _mm512_or_si512(a, b)
#define VLOAD_H(p) _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(p)))
#define VLOAD_U8(p) _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(p))))
#define VLOAD_S8(p) _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(p))))
#define VDP(acc, u, s) _mm512_dpbusd_epi32(acc, u, s)
#define VDP_Q8(acc, w, s) VDP(acc, w, s)
#define Q8_INIT(c) (-(c))
#define VDP2(acc, u1, s1, u2, s2) VDP(VDP(acc, u1, s1), u2, s2)
#define VCVT(a) _mm512_cvtepi32_ps(a)
#define VMUL(a, b) _mm512_mul_ps(a, b)
#define VFMA(a, b, c) _mm512_fmadd_ps(a, b, c)
// up to 8 rows over two vectors: 6 to 16 rows expand each weight block once or twice instead of two to four times
#define RMAX 8
#define CMAX 4
#define TILES(X, F) X(F, 1, 4) X(F, 2, 4) X(F, 3, 2) X(F, 4, 2) X(F, 5, 2) X(F, 6, 2) X(F, 7, 2) X(F, 8, 2)
#include "qgemm_i8_vnni.h"
#pragma GCC pop_options

// ---- AVX-VNNI (VEX, 256-bit, for CPUs without AVX-512): 8 columns per ymm, 16 registers ----
#if defined(__GNUC__) && (__GNUC__ >= 11 || defined(__clang__))
#define HAVE_AVXVNNI 1
#pragma GCC push_options
#pragma GCC target("avx2,fma,avxvnni")
#define PFX(name) avxvnni_##name
#include "qgemm_i8_ymm.h"
#define VDP(acc, u, s) _mm256_dpbusd_avx_epi32(acc, u, s)
#define VDP_Q8(acc, w, s) VDP(acc, w, s)
#define Q8_INIT(c) (-(c))
#define VDP2(acc, u1, s1, u2, s2) VDP(VDP(acc, u1, s1), u2, s2)
#define RMAX 4
#define CMAX 2
#define TILES(X, F) X(F, 1, 2) X(F, 2, 2) X(F, 3, 1) X(F, 4, 1)
#include "qgemm_i8_vnni.h"
#pragma GCC pop_options
#else
#define HAVE_AVXVNNI 0
#endif

// ---- AVX2 (no dot-product instruction: every x86-64 CPU the kernels run on): 8 columns per ymm ----
// vpmaddubsw multiplies u8 x s8 and adds pairs into int16 (saturating), vpmaddwd by ones adds those pairs into
// int32: the same exact dot as VNNI's as long as no int16 sum passes 32767. Activations are -127..127, so two
// pairs summed in int16 (VDP2) stay within 4 x 15 x 127 = 7620 for q4v's nibbles and 4 x 63 x 127 = 32004 for
// q6v's codes. q8v's w = q + 128 would not (255 x 127 x 2):
// it runs signed, |q| <= 128 against x negated where q < 0 (llama.cpp's trick), 32512 at most.
#pragma GCC push_options
#pragma GCC target("avx2,fma")
#define PFX(name) avx2i8_##name
#include "qgemm_i8_ymm.h"
// up to 6 rows in one tile of a single vector (5 and 6 rows run faster as one tile than as 3 + 2 and 3 + 3)
#define RMAX 6
#define CMAX 2
#define TILES(X, F) X(F, 1, 2) X(F, 2, 2) X(F, 3, 1) X(F, 4, 1) X(F, 5, 1) X(F, 6, 1)
#define VPAIRS(p16) _mm256_madd_epi16(p16, _mm256_set1_epi16(1))
#define VDP(acc, u, s) _mm256_add_epi32(acc, VPAIRS(_mm256_maddubs_epi16(u, s)))
#define VDP2(acc, u1, s1, u2, s2) \
    _mm256_add_epi32(acc, VPAIRS(_mm256_add_epi16(_mm256_maddubs_epi16(u1, s1), _mm256_maddubs_epi16(u2, s2))))
static inline __m256i avx2i8_dp_q8(__m256i acc, __m256i w, __m256i s) {
    const __m256i q = _mm256_xor_si256(w, _mm256_set1_epi8((char)0x80));
    return _mm256_add_epi32(acc, VPAIRS(_mm256_maddubs_epi16(_mm256_sign_epi8(q, q), _mm256_sign_epi8(s, q))));
}
#define VDP_Q8(acc, w, s) avx2i8_dp_q8(acc, w, s)
#define Q8_INIT(c) 0
#include "qgemm_i8_vnni.h"
#pragma GCC pop_options

// ---- AMX-INT8: 16 rows x 16 columns x one 32-weight block (q6v / q6kv: half a block) per tile product ----
// The tile unit multiplies a block in a few cycles; storing its 16 x 16 int32 dots and scaling them on AVX-512 (cvt,
// mul, fma per 16 outputs) is the real cost. So each thread expands a column group's weights once into signed B
// tiles for every row tile, keeps a row tile's 16 accumulators in registers, and runs the tile unit ahead of the
// scaling (amx_item).
#if defined(__GNUC__) && (__GNUC__ >= 11 || defined(__clang__))
#define HAVE_AMX_INT8 1
#pragma GCC push_options
#pragma GCC target("avx2,fma,avx512f,avx512bw,avx512vl,avx512vnni,amx-tile,amx-int8")
#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18
#define AMX_ROWS 16  // rows per A tile; a last partial row tile runs on zero rows past the end
#define BT_BYTES 512 // one block's B tile: 8 rows x 64 bytes
// 16 float16 / uint8 / int8 values as floats
#define LOAD_H16(p) _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(p)))
#define LOAD_U8_16(p) _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(p))))
#define LOAD_S8_16(p) _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(p))))

// Linux hands out the tile state only on request: 1 if this process may use AMX.
int i8_amx_init(void) { return syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0; }

typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} __attribute__((packed)) I8TileConfig;

// Tiles 0-1: A (16 rows x 32 int8: one block of each row; q6v: 16, half a block); 2-3: B (8 rows of 16 columns x 4
// bytes; q6v: 4 rows); 4-7: C (16 rows x 16 int32).
static void i8_configure_tiles(int F) {
    const int k = F == Q6V ? QK / 2 : QK;
    I8TileConfig c;
    memset(&c, 0, sizeof c);
    c.palette = 1;
    for (int t = 0; t <= 1; t++) c.rows[t] = AMX_ROWS, c.colsb[t] = (uint16_t)k;
    for (int t = 2; t <= 3; t++) c.rows[t] = (uint8_t)(k / 4), c.colsb[t] = 64;
    for (int t = 4; t <= 7; t++) c.rows[t] = AMX_ROWS, c.colsb[t] = 64;
    _tile_loadconfig(&c);
}

// A column group's blocks -> signed int8 B tiles, BT_BYTES each: q4v's nibbles split into rows 0-3 and 4-7, q8v's
// q + 128 and q6v's q + 32 shifted back (so the product needs no correction term; the dot is the same integer).
// The compact layouts expand to the same tiles (q4kv as q4v, q6kv as q6v, q5v as q8v), and their float scales,
// the wide layouts' floats exactly (the same products as the VNNI kernels'), go to sc: 32 floats a block (d [16],
// then q4: m [16], q6: d1 [16]).
static void amx_expand_group(const int F, const uint8_t *wg, int64_t nb, uint8_t *bt, float *sc) {
    const __m512i lo4 = _mm512_set1_epi8(0x0F);
    for (int64_t b = 0; b < nb; b++) {
        uint8_t *o = bt + b * BT_BYTES;
        if (F == Q4V || F == Q4KV) {
            const uint8_t *src = F == Q4KV ? SB_REC(F, wg, b) + 320 + (b & 7) * 256 : wg + b * TB(F) + WROWS(F);
            for (int j = 0; j < 4; j++) {
                const __m512i v = _mm512_loadu_si512((const void *)(src + 64 * j));
                _mm512_store_si512((void *)(o + 64 * j), _mm512_and_si512(v, lo4));
                _mm512_store_si512((void *)(o + 64 * (j + 4)), _mm512_and_si512(_mm512_srli_epi16(v, 4), lo4));
            }
            if (F == Q4KV) {
                // float16 d [16], m [16], uint8 scale [8][16], min [8][16]
                const uint8_t *rec = SB_REC(F, wg, b);
                const int64_t k = (b & 7) * 16;
                _mm512_store_ps(sc + b * 32, _mm512_mul_ps(LOAD_H16(rec), LOAD_U8_16(rec + 64 + k)));
                _mm512_store_ps(sc + b * 32 + 16, _mm512_mul_ps(LOAD_H16(rec + 32), LOAD_U8_16(rec + 192 + k)));
            }
        } else if (F == Q6KV) {
            // 4 rows of low nibbles (rows 0-3 | rows 4-7 << 4), then the high 2 bits of rows 0-3 and of rows 4-7
            const uint8_t *rec = SB_REC(F, wg, b), *src = rec + 320 + (b & 7) * 384;
            const __m512i off = _mm512_set1_epi8(32);
            const __m512i H0 = _mm512_loadu_si512((const void *)(src + 256));
            const __m512i H1 = _mm512_loadu_si512((const void *)(src + 320));
            for (int j = 0; j < 4; j++) {
                const __m512i v = _mm512_loadu_si512((const void *)(src + 64 * j));
                const __m512i lo = _mm512_or_si512(_mm512_and_si512(v, lo4), avx512vnni_high2(H0, j));
                const __m512i hi =
                    _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(v, 4), lo4), avx512vnni_high2(H1, j));
                _mm512_store_si512((void *)(o + 64 * j), _mm512_sub_epi8(lo, off));
                _mm512_store_si512((void *)(o + 64 * (j + 4)), _mm512_sub_epi8(hi, off));
            }
            // float16 d [16], int8 scale [16 halves][16]
            const __m512 d = LOAD_H16(rec);
            _mm512_store_ps(sc + b * 32, _mm512_mul_ps(d, LOAD_S8_16(rec + 32 + (b & 7) * 32)));
            _mm512_store_ps(sc + b * 32 + 16, _mm512_mul_ps(d, LOAD_S8_16(rec + 32 + (b & 7) * 32 + 16)));
        } else if (F == Q5V) {
            // its pair's record: 4 nibble rows a block, then each block's 5th bits, then each block's float16 d [16]
            const uint8_t *rec = SB_REC(F, wg, b), *src = rec + (b & 1) * 256;
            const __m512i off = _mm512_set1_epi8(16), B = _mm512_loadu_si512((const void *)(rec + 512 + (b & 1) * 64));
            for (int j = 0; j < 4; j++) {
                const __m512i v = _mm512_loadu_si512((const void *)(src + 64 * j));
                const __m512i lo = _mm512_or_si512(_mm512_and_si512(v, lo4), avx512vnni_bit5(B, j));
                const __m512i hi =
                    _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(v, 4), lo4), avx512vnni_bit5(B, j + 4));
                _mm512_store_si512((void *)(o + 64 * j), _mm512_sub_epi8(lo, off));
                _mm512_store_si512((void *)(o + 64 * (j + 4)), _mm512_sub_epi8(hi, off));
            }
            _mm512_store_ps(sc + b * 32, LOAD_H16(rec + 640 + (b & 1) * 32));
        } else {
            const uint8_t *src = wg + b * TB(F) + WROWS(F);
            const __m512i off = _mm512_set1_epi8(F == Q8V ? (char)0x80 : 32);
            for (int j = 0; j < 8; j++) {
                const __m512i v = _mm512_loadu_si512((const void *)(src + 64 * j));
                _mm512_store_si512((void *)(o + 64 * j), _mm512_sub_epi8(v, off));
            }
        }
    }
}

// acc[r] += float(dot[r]) * (d_w * d_x[r]) (q4v: then += m_w * d_x[r] * sum(q_x[r])): the contract at the top, for
// the first R rows of a C tile stored at c (a last partial row tile scales only its real rows: the scaling, not
// the product, is the cost). sd: which scale row of the block (q6v: its half).
static inline __attribute__((always_inline)) void amx_scale(const int F, __m512 acc[AMX_ROWS], const int32_t *c,
                                                            const float *xd, const float *xs, const float *blkd,
                                                            int sd, int64_t R) {
    const __m512 dw = _mm512_loadu_ps(blkd + sd * GROUP), mw = _mm512_loadu_ps(blkd + GROUP);
#pragma GCC unroll 16
    for (int r = 0; r < AMX_ROWS; r++) {
        if (r >= R) break;
        const __m512 dot = _mm512_cvtepi32_ps(_mm512_load_si512((const void *)(c + GROUP * r)));
        acc[r] = _mm512_fmadd_ps(dot, _mm512_mul_ps(dw, _mm512_set1_ps(xd[r])), acc[r]);
        if (F == Q4V) acc[r] = _mm512_fmadd_ps(mw, _mm512_set1_ps(xs[r]), acc[r]);
    }
}

// A row tile in tile order (amx_tile_rows): per block, its 16 rows' 32 int8 (512 bytes: the A tile, stride 32), then
// per block the 16 rows' float d, then their float d * sum(q): every operand of a block's product and scaling is
// one contiguous read (row-major rows put each of the 16 rows, and each of their scales, on its own cache line).
#define AT_BYTES(nb) ((nb) * (BT_BYTES + 2 * AMX_ROWS * (int64_t)sizeof(float)))

static void amx_tile_rows(const uint8_t *xq, int64_t XS, int64_t K, uint8_t *at) {
    const int64_t nb = K / QK;
    float *d = (float *)(at + nb * BT_BYTES), *s = d + nb * AMX_ROWS;
    for (int r = 0; r < AMX_ROWS; r++) {
        const uint8_t *row = xq + r * XS;
        for (int64_t b = 0; b < nb; b++) {
            _mm256_store_si256((__m256i *)(at + b * BT_BYTES + 32 * r), _mm256_loadu_si256((const __m256i *)(row + b * QK)));
            d[b * AMX_ROWS + r] = XD(row, K)[b];
            s[b * AMX_ROWS + r] = XSUM(row, K)[b];
        }
    }
}

// One row tile (16 quantized rows in tile order at at) x one column group (scales in wg, B tiles in bt) over every block; the
// first R rows of the result go to y. pf: the next group's weights to prefetch meanwhile (or NULL): with few rows
// a group's products are short, and its weights come from memory. The unit of work is a block (q6v: a half block,
// with its own scale). Storing a C tile is the slow part (a kilobyte per 8192 multiply-adds), so the tile unit runs
// ahead: step s multiplies unit s, stores unit s - 2 and scales unit s - 3 (stored a step earlier), over A/B tile
// pairs 0/2 and 1/3 and C tiles 4-7 in turn.
#define AMX_PRODUCT(ta, tb, tc, u)                                            \
    do {                                                                      \
        _tile_loadd(ta, at + (u) * UK / QK * BT_BYTES + (u) * UK % QK, 32);   \
        _tile_loadd(tb, bt + (u) * (BT_BYTES * UK / QK), 64);   \
        _tile_zero(tc);                                         \
        _tile_dpbssd(tc, ta, tb);                               \
    } while (0)
// F: the tiles' format (q4v / q8v / q6v); the block's float scales at scl + b * SS; pf's blocks are PB bytes.
static inline __attribute__((always_inline)) void amx_item(const int F, const uint8_t *at, int64_t K,
                                                           const float *scl, int64_t SS, const uint8_t *bt,
                                                           float *y, int64_t N, int64_t R, const uint8_t *pf,
                                                           int64_t PB) {
    const int UK = F == Q6V ? QK / 2 : QK;
    const int64_t nu = K / UK, nb = K / QK;
    const float *xd = (const float *)(at + nb * BT_BYTES), *xs = xd + nb * AMX_ROWS;
    int32_t cb[2][AMX_ROWS * GROUP] __attribute__((aligned(64)));
    __m512 acc[AMX_ROWS];
#pragma GCC unroll 16
    for (int r = 0; r < AMX_ROWS; r++) acc[r] = _mm512_setzero_ps();
    for (int64_t s = 0; s < nu + 3; s++) {
        if (pf && s < K / QK)
            for (int l = 0; l < PB; l += 64) _mm_prefetch((const char *)(pf + s * PB + l), _MM_HINT_T0);
        const int mul = s < nu, st = s >= 2 && s - 2 < nu;
        int32_t *cs = cb[(s - 2) & 1];
        switch (s & 3) {
            case 0:
                if (mul) AMX_PRODUCT(0, 2, 4, s);
                if (st) _tile_stored(6, cs, 64);
                break;
            case 1:
                if (mul) AMX_PRODUCT(1, 3, 5, s);
                if (st) _tile_stored(7, cs, 64);
                break;
            case 2:
                if (mul) AMX_PRODUCT(0, 2, 6, s);
                if (st) _tile_stored(4, cs, 64);
                break;
            default:
                if (mul) AMX_PRODUCT(1, 3, 7, s);
                if (st) _tile_stored(5, cs, 64);
                break;
        }
        const int64_t u = s - 3;
        if (u >= 0) {
            const int64_t b = F == Q6V ? u / 2 : u;
            amx_scale(F, acc, cb[u & 1], xd + b * AMX_ROWS, xs + b * AMX_ROWS, scl + b * SS,
                      F == Q6V ? (int)(u & 1) : 0, R);
        }
    }
#pragma GCC unroll 16
    for (int r = 0; r < AMX_ROWS; r++)
        if (r < R) _mm512_storeu_ps(y + r * N, acc[r]);
}

// A last row tile of at most this many rows runs on the AVX512-VNNI register tiles instead (the same results: see the
// top), over COL_GROUPS column groups at a time while their weights are still in cache: the tile unit's loads,
// products and stores cost as much for 1 row as for 16, and the scaling of one row is a serial chain.
#define AMX_TAIL_ROWS 4
// quantized rows per pass over the weights (bytes): about a third of a Sapphire Rapids core's 2 MB L2
#define AMX_CHUNK_BYTES (768 * 1024)

// xq holds M rows rounded up to whole row tiles (the extra rows zero).
static void amx_gemm(const int F, const float *x, uint8_t *xq, int64_t M, int64_t K, const uint8_t *w, int64_t N,
                     float *y, int nthreads) {
    const int64_t groups = N / GROUP, nb = K / QK, XS = ROW_BYTES(K);
    const int64_t Mp = (M + AMX_ROWS - 1) / AMX_ROWS * AMX_ROWS;
    // rows [0, Ma) on the tile unit, the rest (at most AMX_TAIL_ROWS) on VNNI
    const int64_t Ma = M - M % AMX_ROWS <= AMX_TAIL_ROWS ? M - M % AMX_ROWS : M;
    // the tiles' format, and where the scales are read: the wide blocks' own floats, or the expanded ones
    const int FT = F == Q4KV ? Q4V : F == Q6KV ? Q6V : F == Q5V ? Q8V : F, compact = F != FT;
    const int64_t SS = compact ? 32 : TB(F) / 4;
    const int64_t MC = AMX_CHUNK_BYTES / XS / AMX_ROWS * AMX_ROWS > AMX_ROWS ? AMX_CHUNK_BYTES / XS / AMX_ROWS * AMX_ROWS
                                                                             : AMX_ROWS;
    memset(xq + M * XS, 0, (size_t)((Mp - M) * XS));
    // the rows on the tile unit, in tile order
    const int64_t tiles = (Ma + AMX_ROWS - 1) / AMX_ROWS;
    uint8_t *at = thread_scratch(SCRATCH_ATILES, (size_t)(tiles * AT_BYTES(nb)));
#pragma omp parallel num_threads(nthreads)
    {
#pragma omp for schedule(static)
        for (int64_t m = 0; m < M; m++) quantize_row(x + m * K, K, xq + m * XS);
#pragma omp for schedule(static)
        for (int64_t i = 0; i < tiles; i++) amx_tile_rows(xq + i * AMX_ROWS * XS, XS, K, at + i * AT_BYTES(nb));
        const int64_t t = omp_get_thread_num(), T = omp_get_num_threads();
        const int64_t g0 = groups * t / T, g1 = groups * (t + 1) / T;
        if (g0 < g1) {
            uint8_t *bt = thread_scratch(SCRATCH_BTILES, (size_t)(nb * BT_BYTES));
            float *sc = (float *)thread_scratch(SCRATCH_SCALES, (size_t)(nb * 32 * sizeof(float)));
            i8_configure_tiles(FT);
            // row chunks of MC rows, each over all of the thread's column groups (their tiles expanded again per
            // chunk): a chunk's quantized rows stay in L2 while the groups pass, where all M rows would not
            for (int64_t mc = 0; mc == 0 || mc < Ma; mc += MC) {
                const int64_t me = mc + MC < Ma ? mc + MC : Ma;
                for (int64_t gc = g0; gc < g1; gc += COL_GROUPS) {
                    const int64_t ge = gc + COL_GROUPS < g1 ? gc + COL_GROUPS : g1;
                    for (int64_t g = gc; g < ge && mc < me; g++) {
                        const uint8_t *wg = w + g * nb * TB(F);
                        amx_expand_group(F, wg, nb, bt, sc);
                        const float *scl = compact ? sc : (const float *)wg;
                        for (int64_t m0 = mc; m0 < me; m0 += AMX_ROWS) {
                            const int64_t R = me - m0 < AMX_ROWS ? me - m0 : AMX_ROWS;
                            float *yg = y + m0 * N + g * GROUP;
                            const uint8_t *xa = at + m0 / AMX_ROWS * AT_BYTES(nb);
                            // during the group's last row tile, the next group's weights
                            const uint8_t *pf = m0 + AMX_ROWS >= me && g + 1 < g1 ? wg + nb * TB(F) : NULL;
                            if (FT == Q4V)
                                amx_item(Q4V, xa, K, scl, SS, bt, yg, N, R, pf, TB(F));
                            else if (FT == Q8V)
                                amx_item(Q8V, xa, K, scl, SS, bt, yg, N, R, pf, TB(F));
                            else
                                amx_item(Q6V, xa, K, scl, SS, bt, yg, N, R, pf, TB(F));
                        }
                    }
                    if (mc == 0 && Ma < M) {
                        // (one AVX-512 vector is one column group)
                        const uint8_t *xt = xq + Ma * XS;
                        float *yt = y + Ma * N;
                        if (F == Q4V)
                            avx512vnni_row_tiles(Q4V, M - Ma, xt, XS, K, w, gc, ge, yt, N);
                        else if (F == Q8V)
                            avx512vnni_row_tiles(Q8V, M - Ma, xt, XS, K, w, gc, ge, yt, N);
                        else if (F == Q6V)
                            avx512vnni_row_tiles(Q6V, M - Ma, xt, XS, K, w, gc, ge, yt, N);
                        else if (F == Q4KV)
                            avx512vnni_row_tiles(Q4KV, M - Ma, xt, XS, K, w, gc, ge, yt, N);
                        else if (F == Q6KV)
                            avx512vnni_row_tiles(Q6KV, M - Ma, xt, XS, K, w, gc, ge, yt, N);
                        else
                            avx512vnni_row_tiles(Q5V, M - Ma, xt, XS, K, w, gc, ge, yt, N);
                    }
                }
            }
            _tile_release();
        }
    }
}
#pragma GCC pop_options
#else
#define HAVE_AMX_INT8 0
int i8_amx_init(void) { return 0; }
#endif

// Fewer rows than this run on AVX512-VNNI when AMX-INT8 is asked for (the same results: see the top); its 8-row
// tiles keep up with the tile unit to about 40 rows (benchmarks/kernel_sweep.py --int8-isa all).
#define AMX_MIN_ROWS 33

int qgemm_i8_isas(void) {
    return (HAVE_AVXVNNI << ISA_AVXVNNI) | (1 << ISA_AVX512VNNI) | (HAVE_AMX_INT8 << ISA_AMX) | (1 << ISA_AVX2);
}

// gemm(F, ...) with the weight format as a constant, so each format gets its own inlined body
#define GEMM_BY_FMT(gemm)                                        \
    do {                                                         \
        if (fmt == Q4V)                                          \
            gemm(Q4V, x, xq, M, K, w, N, y, nthreads);           \
        else if (fmt == Q8V)                                     \
            gemm(Q8V, x, xq, M, K, w, N, y, nthreads);           \
        else if (fmt == Q6V)                                     \
            gemm(Q6V, x, xq, M, K, w, N, y, nthreads);           \
        else if (fmt == Q4KV)                                    \
            gemm(Q4KV, x, xq, M, K, w, N, y, nthreads);          \
        else if (fmt == Q6KV)                                    \
            gemm(Q6KV, x, xq, M, K, w, N, y, nthreads);          \
        else                                                     \
            gemm(Q5V, x, xq, M, K, w, N, y, nthreads);           \
    } while (0)

void qgemm_i8(int isa, int fmt, const float *x, int64_t M, int64_t K, const uint8_t *w, int64_t N, float *y,
              int nthreads) {
    if (M <= 0) return;
    // AMX reads whole row tiles: room for up to 15 zero rows past the end
    uint8_t *xq = thread_scratch(SCRATCH_ROWS, (size_t)((M + 15) * ROW_BYTES(K)) + 64);
    if (isa == ISA_AMX && M < AMX_MIN_ROWS) isa = ISA_AVX512VNNI;
#if HAVE_AMX_INT8
    if (isa == ISA_AMX) {
        GEMM_BY_FMT(amx_gemm);
        return;
    }
#endif
#if HAVE_AVXVNNI
    if (isa == ISA_AVXVNNI) {
        GEMM_BY_FMT(avxvnni_gemm);
        return;
    }
#endif
    if (isa == ISA_AVX2)
        GEMM_BY_FMT(avx2i8_gemm);
    else
        GEMM_BY_FMT(avx512vnni_gemm);
}
