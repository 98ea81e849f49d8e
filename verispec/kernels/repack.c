// Load-time repacking of GGUF blocks into the layouts of verispec/kernels/qweight.py (q4, q6; q4t / q8t for the
// AMX build) and their dequantization: the same bytes and values as qweight.py's numpy code, which stays the
// reference (tests/unit/kernels/test_repack.py compares them bitwise) and the path without a kernel library.
// Plain scalar C: one pass over the weights, split over threads by rows or column groups.
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "kernels.h"

#define QK 32
#define GROUP 16

// IEEE half -> float, exactly (subnormals, infinities and NaNs included)
static float half_to_float(const uint8_t *p) {
    uint16_t h = (uint16_t)(p[0] | (p[1] << 8));
    uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 0x1F, man = h & 0x3FF, bits;
    if (exp == 0x1F) {
        bits = sign | 0x7F800000u | (man << 13);
    } else if (exp) {
        bits = sign | ((exp + 112) << 23) | (man << 13);
    } else if (man) {
        // subnormal: normalise
        int e = -1;
        do {
            e++;
            man <<= 1;
        } while (!(man & 0x400));
        bits = sign | ((uint32_t)(112 - e) << 23) | ((man & 0x3FF) << 13);
    } else {
        bits = sign;
    }
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

// one q4 block (24 bytes) from d, m and 32 values 0..15 in weight order: word 2h + parity, nibble t = weight
// 16h + 2t + parity
static void put_q4(uint8_t *out, float d, float m, const uint8_t *q) {
    uint32_t w[4] = {0, 0, 0, 0};
    for (int i = 0; i < QK; i++) {
        int h = i >> 4, r = i & 15;
        w[2 * h + (r & 1)] |= (uint32_t)q[i] << (4 * (r >> 1));
    }
    memcpy(out, &d, 4);
    memcpy(out + 4, &m, 4);
    memcpy(out + 8, w, 16);
}

// the inverse: a q4 block's d, m and 32 values in weight order
static void get_q4(const uint8_t *in, float *d, float *m, uint8_t *q) {
    uint32_t w[4];
    memcpy(d, in, 4);
    memcpy(m, in + 4, 4);
    memcpy(w, in + 8, 16);
    for (int i = 0; i < QK; i++) {
        int h = i >> 4, r = i & 15;
        q[i] = (w[2 * h + (r & 1)] >> (4 * (r >> 1))) & 15;
    }
}

void repack_q4k(const uint8_t *src, int64_t N, int64_t nsb, uint8_t *dst, int nthreads) {
#pragma omp parallel for num_threads(nthreads) schedule(static)
    for (int64_t n = 0; n < N; n++) {
        for (int64_t s = 0; s < nsb; s++) {
            const uint8_t *b = src + (n * nsb + s) * 144;
            float d = half_to_float(b), dmin = half_to_float(b + 2);
            const uint8_t *lo = b + 4, *hi = b + 8, *mix = b + 12, *qs = b + 16;
            for (int j = 0; j < 8; j++) {
                int sc = j < 4 ? lo[j] & 63 : (mix[j - 4] & 15) | ((lo[j - 4] >> 2) & 0x30);
                int mn = j < 4 ? hi[j] & 63 : (mix[j - 4] >> 4) | ((hi[j - 4] >> 2) & 0x30);
                // sub-block j: bytes 32 * (j / 2).., low nibbles for even j, high for odd
                uint8_t q[QK];
                for (int w = 0; w < QK; w++) q[w] = (qs[32 * (j >> 1) + w] >> (4 * (j & 1))) & 15;
                put_q4(dst + ((n * nsb + s) * 8 + j) * 24, d * (float)sc, -(dmin * (float)mn), q);
            }
        }
    }
}

void repack_q6k(const uint8_t *src, int64_t N, int64_t nsb, uint8_t *dst, int nthreads) {
#pragma omp parallel for num_threads(nthreads) schedule(static)
    for (int64_t n = 0; n < N; n++) {
        for (int64_t s = 0; s < nsb; s++) {
            const uint8_t *b = src + (n * nsb + s) * 210, *ql = b, *qh = b + 128;
            const int8_t *scales = (const int8_t *)(b + 192);
            float d = half_to_float(b + 208);
            for (int c = 0; c < 8; c++) {
                uint8_t *out = dst + ((n * nsb + s) * 8 + c) * 40;
                float ds[2] = {d * (float)scales[2 * c], d * (float)scales[2 * c + 1]};
                memcpy(out, ds, 8);
                int half = c >> 2, shift = (c >> 1) & 1, sub = c & 1, s2 = c & 3;
                for (int w = 0; w < QK; w++) {
                    int l = (ql[half * 64 + sub * 32 + w] >> (4 * shift)) & 15;
                    int h = (qh[half * 32 + w] >> (2 * s2)) & 3;
                    out[8 + w] = (uint8_t)(int8_t)((l | (h << 4)) - 32);
                }
            }
        }
    }
}

void tile_q4(const uint8_t *src, int64_t N, int64_t nb, uint8_t *dst, int nthreads) {
    int64_t G = N / GROUP;
#pragma omp parallel for num_threads(nthreads) schedule(static)
    for (int64_t g = 0; g < G; g++) {
        for (int64_t b = 0; b < nb; b++) {
            uint8_t *out = dst + (g * nb + b) * 384;
            float d[GROUP], m[GROUP];
            uint8_t q[GROUP][QK];
            for (int c = 0; c < GROUP; c++) get_q4(src + ((g * GROUP + c) * nb + b) * 24, &d[c], &m[c], q[c]);
            memcpy(out, d, 64);
            memcpy(out + 64, m, 64);
            // word (c, j) of the nibble plane, nibble t: column j / 2, k = 2r + j % 2 with B-tile row r = 4t + c
            uint16_t plane[4][32];
            for (int c = 0; c < 4; c++) {
                for (int j = 0; j < 32; j++) {
                    uint16_t word = 0;
                    for (int t = 0; t < 4; t++) word |= (uint16_t)(q[j >> 1][2 * (4 * t + c) + (j & 1)] << (4 * t));
                    plane[c][j] = word;
                }
            }
            memcpy(out + 128, plane, 256);
        }
    }
}

void tile_q8(const uint8_t *src, int64_t N, int64_t nb, uint8_t *dst, int nthreads) {
    int64_t G = N / GROUP;
#pragma omp parallel for num_threads(nthreads) schedule(static)
    for (int64_t g = 0; g < G; g++) {
        for (int64_t b = 0; b < nb; b++) {
            uint8_t *out = dst + (g * nb + b) * 576;
            for (int c = 0; c < GROUP; c++) {
                const uint8_t *in = src + ((g * GROUP + c) * nb + b) * 36;
                memcpy(out + 4 * c, in, 4);
                // byte (r, column, pair) = weight k = 2r + pair of the column
                for (int r = 0; r < 16; r++) {
                    out[64 + (r * GROUP + c) * 2] = in[4 + 2 * r];
                    out[64 + (r * GROUP + c) * 2 + 1] = in[4 + 2 * r + 1];
                }
            }
        }
    }
}

// q4 / q8 / q6 rows (fmt 0 / 1 / 2) into the int8-activation layouts q4v / q8v / q6v (qgemm_i8.c's header): per
// group of 16 columns and block, the columns' scales side by side, then 8 rows of 64 bytes, row j holding for
// column c (bytes 4c..4c+3) the weights k = 4j..4j+3 (q4v: rows 0-3 in the low nibbles, 4-7 in the high ones;
// q8v: q + 128; q6v: q + 32). The values qweight.py's numpy conversion gives, byte for byte (tested).
void int8_layout(int fmt, const uint8_t *src, int64_t N, int64_t nb, uint8_t *dst, int nthreads) {
    static const int64_t in_bytes[3] = {24, 36, 40}, out_bytes[3] = {384, 576, 640};
    const int64_t G = N / GROUP;
#pragma omp parallel for num_threads(nthreads) schedule(static)
    for (int64_t g = 0; g < G; g++) {
        for (int64_t b = 0; b < nb; b++) {
            uint8_t *out = dst + (g * nb + b) * out_bytes[fmt];
            // [column][k] the weights as stored bytes (q4: 0..15, q8: q + 128, q6: q + 32)
            uint8_t q[GROUP][QK];
            for (int c = 0; c < GROUP; c++) {
                const uint8_t *in = src + ((g * GROUP + c) * nb + b) * in_bytes[fmt];
                if (fmt == 0) {
                    float d, m;
                    get_q4(in, &d, &m, q[c]);
                    memcpy(out + 4 * c, &d, 4);
                    memcpy(out + 64 + 4 * c, &m, 4);
                } else if (fmt == 1) {
                    memcpy(out + 4 * c, in, 4);
                    for (int k = 0; k < QK; k++) q[c][k] = in[4 + k] ^ 0x80;
                } else {
                    memcpy(out + 4 * c, in, 4);
                    memcpy(out + 64 + 4 * c, in + 4, 4);
                    for (int k = 0; k < QK; k++) q[c][k] = (uint8_t)((int8_t)in[8 + k] + 32);
                }
            }
            uint8_t *rows = out + (fmt == 1 ? 64 : 128);
            if (fmt == 0) {
                for (int j = 0; j < 4; j++)
                    for (int c = 0; c < GROUP; c++)
                        for (int i = 0; i < 4; i++)
                            rows[j * 64 + 4 * c + i] = q[c][4 * j + i] | (uint8_t)(q[c][16 + 4 * j + i] << 4);
            } else {
                for (int j = 0; j < 8; j++)
                    for (int c = 0; c < GROUP; c++)
                        for (int i = 0; i < 4; i++) rows[j * 64 + 4 * c + i] = q[c][4 * j + i];
            }
        }
    }
}

// Factors n float32 values as one float16 d times integers s_j in [lo, hi] with d * s_j == v_j bit for bit; 0 where
// no such pair exists. The K-quants' scales are such products (d * a 6-bit or int8 scale, exact in float32), and
// llama.cpp's quantizers put the largest one at 63 (Q4_K) or -128 (Q6_K): those are tried first, then every value.
static int factor_f16(const float *v, int n, int lo, int hi, uint16_t *d16, int *s) {
    static const int likely[] = {63, -128, 127, 31, -64};
    int jm = 0;
    for (int j = 1; j < n; j++)
        if (fabsf(v[j]) > fabsf(v[jm])) jm = j;
    if (!isfinite(v[jm])) return 0;
    const int nl = (int)(sizeof likely / sizeof likely[0]);
    for (int t = 0; t < nl + hi - lo + 1; t++) {
        const int sm = t < nl ? likely[t] : lo + (t - nl);
        if (sm < lo || sm > hi || (sm == 0) != (v[jm] == 0.0f)) continue;
        // all zero: d = +-1, the zeros' sign
        const float d = sm ? v[jm] / (float)sm : (signbit(v[0]) ? -1.0f : 1.0f);
        const uint16_t h = _cvtss_sh(d, 0);
        const float dh = _cvtsh_ss(h);
        int ok = dh == d;
        for (int j = 0; j < n && ok; j++) {
            const float q = sm ? rintf(v[j] / dh) : 0.0f;
            s[j] = q >= (float)lo && q <= (float)hi ? (int)q : 0;
            // what the kernels compute: float16 d times the integer (a zero's sign is d's)
            const float p = dh * (float)s[j];
            ok = q >= (float)lo && q <= (float)hi && memcmp(&p, &v[j], 4) == 0;
        }
        if (ok) {
            *d16 = h;
            return 1;
        }
    }
    return 0;
}

// A conversion that may not fit (int8_compact, int8_q5) stops once one block fails: the flag is shared by the
// threads, which skip their remaining column groups (weights of another origin fail at once).
static int conversion_failed(const int *failed) {
    int v;
#pragma omp atomic read
    v = *failed;
    return v;
}

static void fail_conversion(int *failed) {
#pragma omp atomic write
    *failed = 1;
}

// column c's bytes 4c..4c+3 of 4 rows of 64: row j holds the low 4 bits of q[4j..4j+3] in its low nibbles and of
// q[16+4j..] in its high ones (q4v's rows, and the nibble plane of q6kv / q5v)
static void put_nibble_rows(uint8_t *rows, int c, const uint8_t *q) {
    for (int j = 0; j < 4; j++)
        for (int k = 0; k < 4; k++)
            rows[64 * j + 4 * c + k] = (uint8_t)((q[4 * j + k] & 15) | ((q[16 + 4 * j + k] & 15) << 4));
}

// q4 / q6 rows (fmt 0 / 2) made from Q4_K / Q6_K into the compact int8-activation layouts q4kv / q6kv (qgemm_i8.c's
// header): per group of 16 columns and super-block of 256 weights, a 320-byte record of the columns' float16 d
// (and q4kv's m) and integer scales, then the 8 blocks' weight rows. -> 1 where a (column, super-block)'s scales
// do not factor (then dst is incomplete and the caller keeps q4v / q6v), else 0.
int64_t int8_compact(int fmt, const uint8_t *src, int64_t N, int64_t nb, uint8_t *dst, int nthreads) {
    const int64_t G = N / GROUP, nsb = nb / 8, in_bytes = fmt == 0 ? 24 : 40, sb_bytes = fmt == 0 ? 2368 : 3392;
    const int rb = fmt == 0 ? 256 : 384;
    int failed = 0;
#pragma omp parallel for num_threads(nthreads) schedule(static)
    for (int64_t g = 0; g < G; g++) {
        if (conversion_failed(&failed)) continue;
        for (int64_t sb = 0; sb < nsb; sb++) {
            uint8_t *out = dst + (g * nsb + sb) * sb_bytes;
            memset(out, 0, (size_t)sb_bytes);
            for (int c = 0; c < GROUP; c++) {
                const uint8_t *in = src + ((g * GROUP + c) * nb + sb * 8) * in_bytes;
                // [block][k] the weights as stored bytes (q4: 0..15, q6: q + 32)
                uint8_t q[8][QK];
                uint16_t dh, mh = 0;
                int sd[16], sm[8], ok;
                if (fmt == 0) {
                    float d[8], m[8];
                    for (int i = 0; i < 8; i++) get_q4(in + i * in_bytes, &d[i], &m[i], q[i]);
                    ok = factor_f16(d, 8, 0, 255, &dh, sd) && factor_f16(m, 8, 0, 255, &mh, sm);
                } else {
                    float ds[16];
                    for (int i = 0; i < 8; i++) {
                        memcpy(ds + 2 * i, in + i * in_bytes, 8);
                        for (int k = 0; k < QK; k++) q[i][k] = (uint8_t)((int8_t)in[i * in_bytes + 8 + k] + 32);
                    }
                    ok = factor_f16(ds, 16, -128, 127, &dh, sd);
                }
                if (!ok) {
                    fail_conversion(&failed);
                    continue;
                }
                memcpy(out + 2 * c, &dh, 2);
                if (fmt == 0) {
                    memcpy(out + 32 + 2 * c, &mh, 2);
                    for (int i = 0; i < 8; i++) out[64 + 16 * i + c] = (uint8_t)sd[i], out[192 + 16 * i + c] = (uint8_t)sm[i];
                } else {
                    for (int i = 0; i < 16; i++) out[32 + 16 * i + c] = (uint8_t)(int8_t)sd[i];
                }
                // the nibble rows; q6kv's high 2 bits in two more rows (k < 16, k >= 16), bits 2j..2j+1 for row j
                for (int i = 0; i < 8; i++) {
                    uint8_t *rows = out + 320 + i * rb;
                    put_nibble_rows(rows, c, q[i]);
                    if (fmt == 2)
                        for (int j = 0; j < 4; j++)
                            for (int k = 0; k < 4; k++) {
                                rows[256 + 4 * c + k] |= (uint8_t)((q[i][4 * j + k] >> 4) << (2 * j));
                                rows[320 + 4 * c + k] |= (uint8_t)((q[i][16 + 4 * j + k] >> 4) << (2 * j));
                            }
                }
            }
        }
    }
    return failed;
}

// q8 rows whose q lie in -16..15 with float16 scales (Q5_0 weights) into the int8-activation layout q5v
// (qgemm_i8.c's header), per group of 16 columns and pair of blocks. -> 1 where a block does not fit (then dst is
// incomplete and the caller keeps q8v), else 0.
int64_t int8_q5(const uint8_t *src, int64_t N, int64_t nb, uint8_t *dst, int nthreads) {
    const int64_t G = N / GROUP, np = nb / 2;
    int failed = 0;
#pragma omp parallel for num_threads(nthreads) schedule(static)
    for (int64_t g = 0; g < G; g++) {
        if (conversion_failed(&failed)) continue;
        for (int64_t p = 0; p < np; p++) {
            uint8_t *out = dst + (g * np + p) * 704;
            memset(out, 0, 704);
            for (int i = 0; i < 2; i++)
                for (int c = 0; c < GROUP; c++) {
                    const uint8_t *in = src + ((g * GROUP + c) * nb + 2 * p + i) * 36;
                    float d;
                    memcpy(&d, in, 4);
                    const uint16_t h = _cvtss_sh(d, 0);
                    int ok = d == d && _cvtsh_ss(h) == d;
                    // q + 16: 0..31
                    uint8_t q[QK];
                    for (int k = 0; k < QK && ok; k++) {
                        ok = (int8_t)in[4 + k] >= -16 && (int8_t)in[4 + k] <= 15;
                        q[k] = (uint8_t)((int8_t)in[4 + k] + 16);
                    }
                    if (!ok) {
                        fail_conversion(&failed);
                        continue;
                    }
                    memcpy(out + 640 + 32 * i + 2 * c, &h, 2);
                    put_nibble_rows(out + 256 * i, c, q);
                    // the 5th bits: bit j of byte 4c + k for row j, bit j + 4 for row j + 4
                    for (int j = 0; j < 4; j++)
                        for (int k = 0; k < 4; k++)
                            out[512 + 64 * i + 4 * c + k] |=
                                (uint8_t)(((q[4 * j + k] >> 4) << j) | ((q[16 + 4 * j + k] >> 4) << (j + 4)));
                }
        }
    }
    return failed;
}

// one q4 / q8 / q6 block (fmt 0 / 1 / 2) to its 32 float32 weights
static void dequant_block(int fmt, const uint8_t *in, float *out) {
    if (fmt == 0) {
        float d, m;
        uint8_t q[QK];
        get_q4(in, &d, &m, q);
        for (int i = 0; i < QK; i++) out[i] = d * (float)q[i] + m;
    } else if (fmt == 1) {
        float d;
        memcpy(&d, in, 4);
        for (int i = 0; i < QK; i++) out[i] = d * (float)(int8_t)in[4 + i];
    } else {
        float ds[2];
        memcpy(ds, in, 8);
        for (int i = 0; i < QK; i++) out[i] = ds[i >> 4] * (float)(int8_t)in[8 + i];
    }
}

static const int64_t BLOCK_BYTES[3] = {24, 36, 40};

void dequant_rows(int fmt, const uint8_t *src, int64_t N, int64_t nb, float *dst, int nthreads) {
#pragma omp parallel for num_threads(nthreads) schedule(static)
    for (int64_t n = 0; n < N; n++) {
        for (int64_t b = 0; b < nb; b++) dequant_block(fmt, src + (n * nb + b) * BLOCK_BYTES[fmt], dst + (n * nb + b) * QK);
    }
}

int64_t dequant_gather(int fmt, const uint8_t *src, int64_t N, int64_t nb, const int64_t *rows, int64_t M,
                       float *dst) {
    for (int64_t i = 0; i < M; i++)
        if (rows[i] < 0 || rows[i] >= N) return i;
    for (int64_t i = 0; i < M; i++) {
        const uint8_t *row = src + rows[i] * nb * BLOCK_BYTES[fmt];
        for (int64_t b = 0; b < nb; b++) dequant_block(fmt, row + b * BLOCK_BYTES[fmt], dst + (i * nb + b) * QK);
    }
    return -1;
}
