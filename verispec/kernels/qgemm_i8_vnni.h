// The register-tile body of qgemm_i8.c, included once per variant inside its `#pragma GCC target` region.
// The includer defines:
//   PFX(name)   the variant's function names (avx512vnni_name / avxvnni_name / avx2i8_name)
//   VW          output columns per vector: 16 (zmm) or 8 (ymm); a 16-column group is 16 / VW vectors
//   vi, vf      integer / float vector types
//   VZERO_I(), VSET1_I(v), VSET1_F(v), VLOAD_I(p), VLOAD_F(p), VSTORE_F(p, v), VAND(a, b), VOR(a, b),
//   VSRL16(a, n), VSLL16(a, n), VCVT(a), VMUL(a, b), VFMA(a, b, c), and VLOAD_H(p) / VLOAD_U8(p) / VLOAD_S8(p):
//   VW float16 / uint8 / int8 values as floats
//   VDP(acc, u8, s8)      acc (int32 lanes) += the sum of 4 byte products u8 x s8 per lane
//   VDP_Q8(acc, w, s8)    the same for q8v's weight bytes w = q + 128, and Q8_INIT(c) the dot's start given
//                         c = 128 * sum(q_x): VNNI multiplies w as unsigned and starts at -c; AVX2 takes w - 128
//                         as signed (its byte products would saturate on w up to 255) and starts at 0
//   VDP2(acc, u1, s1, u2, s2)  VDP of both pairs (AVX2: summed in int16 first, exact for q4v and q6v)
//   RMAX, CMAX  the largest register tile (rows x vectors) and TILES(X, F) the tile list for row counts 1..RMAX
// and the end of this file undefines them all, ready for the next variant.
//
// A tile of R rows x C vectors runs over all K / 32 blocks. Per block the int32 dot of each row with each column
// is exact (VDP sums 4 byte products per lane, 8 of them cover the block); then, per lane and in this order,
//   acc = fma(float(dot), d_w * d_x, acc)   and for q4v   acc = fma(m_w, d_x * sum(q_x), acc).
// q6v has two scales per block: the dot of each half (16 k, 4 VDPs) is folded in on its own,
//   acc = fma(float(dot_0), d0_w * d_x, acc), then acc = fma(float(dot_1), d1_w * d_x, acc).
// q4kv / q6kv are q4v / q6v with the super-block's scales factored (d_w = float16 d x an integer, exact), q5v is
// q8v for 5-bit weights: the same dots and the same float sequence, only fewer bytes to read.
// That per-column float sequence is the contract every int8 variant (this one at either width, and AMX-INT8)
// follows, so all of them give bitwise the same y, whatever the tile or the number of rows.

// q6kv: row j's high 2 bits (bits 2j..2j+1 of H's bytes) moved to bits 4-5 of each byte (16-bit shifts: what
// crosses into the neighbour byte falls outside the 0x30 mask)
static inline vi PFX(high2)(vi H, int j) {
    const vi m30 = VSET1_I(0x30303030);
    return VAND(j == 0 ? VSLL16(H, 4) : j == 1 ? VSLL16(H, 2) : j == 2 ? H : VSRL16(H, 2), m30);
}

// q5v: row j's 5th bits (bit j of B's bytes) moved to bit 4 of each byte (16-bit shifts: what crosses into the
// neighbour byte falls outside the 0x10 mask)
static inline vi PFX(bit5)(vi B, int j) {
    const vi m10 = VSET1_I(0x10101010);
    return VAND(j < 4 ? VSLL16(B, 4 - j) : j == 4 ? B : VSRL16(B, j - 4), m10);
}

static inline vi PFX(bcast4)(const uint8_t *p) {
    int32_t v;
    memcpy(&v, p, 4);
    return VSET1_I(v);
}

// One R x C tile: rows x (XS bytes apart, qgemm_i8.c's row layout), vectors u0 .. u0 + C - 1 (VW columns each)
// of w, results to y (row stride N).
static inline __attribute__((always_inline)) void PFX(tile)(const int F, const int R, const int C,
                                                            const uint8_t *x, int64_t XS, int64_t K,
                                                            const uint8_t *w, int64_t u0, float *y, int64_t N) {
    const int64_t nb = K / QK;
    // wu[c]: vector c's column group at block 0, offset to its half (VW columns) of each 64-byte row
    const uint8_t *wu[CMAX];
    int64_t hu[CMAX];
    for (int c = 0; c < C; c++) {
        hu[c] = (u0 + c) % (GROUP / VW);
        wu[c] = w + (u0 + c) / (GROUP / VW) * nb * TB(F);
    }
    vf acc[RMAX][CMAX];
    for (int r = 0; r < R; r++)
        for (int c = 0; c < C; c++) acc[r][c] = VSET1_F(0.0f);
    for (int64_t b = 0; b < nb; b++) {
        vi dot[RMAX][CMAX];
        const uint8_t *xb = x + b * QK;
        // the weights PF_BLOCKS blocks ahead (past the end of a group: the next group's, harmless)
        for (int c = 0; c < C; c++)
            for (int l = 0; l < TB(F); l += 64)
                _mm_prefetch((const char *)(wu[c] + (b + PF_BLOCKS) * TB(F) + l), _MM_HINT_T0);
        if (F == Q6KV) {
            // super-block record: float16 d [16], int8 scale [16 halves][16], then block b % 8's 384 bytes: 4 rows of
            // low nibbles (rows 0-3 | rows 4-7 << 4), the high 2 bits of rows 0-3, of rows 4-7
            const vi lo4 = VSET1_I(0x0F0F0F0F);
            for (int h = 0; h < 2; h++) {
                for (int r = 0; r < R; r++) {
                    const vi init = VSET1_I(-(h ? XH1(x + r * XS, K) : XH0(x + r * XS, K))[b]);
                    for (int c = 0; c < C; c++) dot[r][c] = init;
                }
                for (int j = 0; j < 4; j += 2) {
                    vi w0[CMAX], w1[CMAX];
                    for (int c = 0; c < C; c++) {
                        const uint8_t *rw = SB_REC(F, wu[c], b) + 320 + (b & 7) * 384 + hu[c] * VW * 4;
                        const vi v0 = VLOAD_I(rw + 64 * j), v1 = VLOAD_I(rw + 64 * (j + 1));
                        const vi H = VLOAD_I(rw + 256 + 64 * h);
                        w0[c] = VOR(VAND(h ? VSRL16(v0, 4) : v0, lo4), PFX(high2)(H, j));
                        w1[c] = VOR(VAND(h ? VSRL16(v1, 4) : v1, lo4), PFX(high2)(H, j + 1));
                    }
                    for (int r = 0; r < R; r++) {
                        const uint8_t *xr = xb + r * XS + 16 * h + 4 * j;
                        const vi x0 = PFX(bcast4)(xr), x1 = PFX(bcast4)(xr + 4);
                        for (int c = 0; c < C; c++) dot[r][c] = VDP2(dot[r][c], w0[c], x0, w1[c], x1);
                    }
                }
                vf dh[CMAX];
                for (int c = 0; c < C; c++) {
                    const uint8_t *rec = SB_REC(F, wu[c], b);
                    dh[c] = VMUL(VLOAD_H(rec + hu[c] * VW * 2), VLOAD_S8(rec + 32 + ((b & 7) * 2 + h) * 16 + hu[c] * VW));
                }
                for (int r = 0; r < R; r++) {
                    const vf dx = VSET1_F(XD(x + r * XS, K)[b]);
                    for (int c = 0; c < C; c++) acc[r][c] = VFMA(VCVT(dot[r][c]), VMUL(dh[c], dx), acc[r][c]);
                }
            }
            continue;
        }
        if (F == Q5V) {
            // block b of its pair's record: 4 nibble rows at (b % 2) * 256, 5th bits at 512 + (b % 2) * 64, float16
            // d at 640 + (b % 2) * 32
            const vi lo4 = VSET1_I(0x0F0F0F0F);
            for (int r = 0; r < R; r++) {
                const vi init = VSET1_I(-(XC(x + r * XS, K)[b] >> 3));
                for (int c = 0; c < C; c++) dot[r][c] = init;
            }
            for (int j = 0; j < 4; j++) {
                vi lo[CMAX], hi[CMAX];
                for (int c = 0; c < C; c++) {
                    const uint8_t *rec = SB_REC(F, wu[c], b), *o = rec + hu[c] * VW * 4;
                    const vi v = VLOAD_I(o + (b & 1) * 256 + 64 * j), B = VLOAD_I(o + 512 + (b & 1) * 64);
                    lo[c] = VOR(VAND(v, lo4), PFX(bit5)(B, j));
                    hi[c] = VOR(VAND(VSRL16(v, 4), lo4), PFX(bit5)(B, j + 4));
                }
                for (int r = 0; r < R; r++) {
                    const vi xl = PFX(bcast4)(xb + r * XS + 4 * j), xh = PFX(bcast4)(xb + r * XS + 16 + 4 * j);
                    for (int c = 0; c < C; c++) dot[r][c] = VDP2(dot[r][c], lo[c], xl, hi[c], xh);
                }
            }
            vf dw[CMAX];
            for (int c = 0; c < C; c++) dw[c] = VLOAD_H(SB_REC(F, wu[c], b) + 640 + (b & 1) * 32 + hu[c] * VW * 2);
            for (int r = 0; r < R; r++) {
                const vf dx = VSET1_F(XD(x + r * XS, K)[b]);
                for (int c = 0; c < C; c++) acc[r][c] = VFMA(VCVT(dot[r][c]), VMUL(dw[c], dx), acc[r][c]);
            }
            continue;
        }
        if (F == Q6V) {
            for (int h = 0; h < 2; h++) {
                for (int r = 0; r < R; r++) {
                    const vi init = VSET1_I(-(h ? XH1(x + r * XS, K) : XH0(x + r * XS, K))[b]);
                    for (int c = 0; c < C; c++) dot[r][c] = init;
                }
                for (int j = 4 * h; j < 4 * h + 4; j += 2) {
                    vi w0[CMAX], w1[CMAX];
                    for (int c = 0; c < C; c++) {
                        w0[c] = VLOAD_I(wu[c] + b * TB(F) + 128 + 64 * j + hu[c] * VW * 4);
                        w1[c] = VLOAD_I(wu[c] + b * TB(F) + 128 + 64 * (j + 1) + hu[c] * VW * 4);
                    }
                    for (int r = 0; r < R; r++) {
                        const vi x0 = PFX(bcast4)(xb + r * XS + 4 * j), x1 = PFX(bcast4)(xb + r * XS + 4 * j + 4);
                        for (int c = 0; c < C; c++) dot[r][c] = VDP2(dot[r][c], w0[c], x0, w1[c], x1);
                    }
                }
                vf dh[CMAX];
                for (int c = 0; c < C; c++)
                    dh[c] = VLOAD_F((const float *)(wu[c] + b * TB(F)) + h * GROUP + hu[c] * VW);
                for (int r = 0; r < R; r++) {
                    const vf dx = VSET1_F(XD(x + r * XS, K)[b]);
                    for (int c = 0; c < C; c++) acc[r][c] = VFMA(VCVT(dot[r][c]), VMUL(dh[c], dx), acc[r][c]);
                }
            }
            continue;
        }
        for (int r = 0; r < R; r++) {
            const vi init = F == Q8V ? VSET1_I(Q8_INIT(XC(x + r * XS, K)[b])) : VZERO_I();
            for (int c = 0; c < C; c++) dot[r][c] = init;
        }
        if (F == Q4V || F == Q4KV) {
            const vi lo4 = VSET1_I(0x0F0F0F0F);
            for (int j = 0; j < 4; j++) {
                vi lo[CMAX], hi[CMAX];
                for (int c = 0; c < C; c++) {
                    const uint8_t *rw = F == Q4KV ? SB_REC(F, wu[c], b) + 320 + (b & 7) * 256 : wu[c] + b * TB(F) + 128;
                    const vi v = VLOAD_I(rw + 64 * j + hu[c] * VW * 4);
                    lo[c] = VAND(v, lo4);
                    hi[c] = VAND(VSRL16(v, 4), lo4);
                }
                for (int r = 0; r < R; r++) {
                    const vi xl = PFX(bcast4)(xb + r * XS + 4 * j), xh = PFX(bcast4)(xb + r * XS + 16 + 4 * j);
                    for (int c = 0; c < C; c++) dot[r][c] = VDP2(dot[r][c], lo[c], xl, hi[c], xh);
                }
            }
        } else {
            for (int j = 0; j < 8; j++) {
                vi wv[CMAX];
                for (int c = 0; c < C; c++) wv[c] = VLOAD_I(wu[c] + b * TB(F) + 64 + 64 * j + hu[c] * VW * 4);
                for (int r = 0; r < R; r++) {
                    const vi xv = PFX(bcast4)(xb + r * XS + 4 * j);
                    for (int c = 0; c < C; c++) dot[r][c] = VDP_Q8(dot[r][c], wv[c], xv);
                }
            }
        }
        // the block's scales: float d [16] at its start, then (q4v) float m [16]; this vector's VW of them (q4kv:
        // float16 d [16] and m [16] of the super-block times the block's uint8 scales [16] and mins [16], exact)
        vf dw[CMAX], mw[CMAX];
        for (int c = 0; c < C; c++) {
            if (F == Q4KV) {
                const uint8_t *rec = SB_REC(F, wu[c], b);
                const int64_t o = (b & 7) * 16 + hu[c] * VW;
                dw[c] = VMUL(VLOAD_H(rec + hu[c] * VW * 2), VLOAD_U8(rec + 64 + o));
                mw[c] = VMUL(VLOAD_H(rec + 32 + hu[c] * VW * 2), VLOAD_U8(rec + 192 + o));
                continue;
            }
            const float *d = (const float *)(wu[c] + b * TB(F)) + hu[c] * VW;
            dw[c] = VLOAD_F(d);
            mw[c] = F == Q4V ? VLOAD_F(d + GROUP) : dw[c];
        }
        for (int r = 0; r < R; r++) {
            const vf dx = VSET1_F(XD(x + r * XS, K)[b]), sx = VSET1_F(XSUM(x + r * XS, K)[b]);
            for (int c = 0; c < C; c++) {
                acc[r][c] = VFMA(VCVT(dot[r][c]), VMUL(dw[c], dx), acc[r][c]);
                if (F == Q4V || F == Q4KV) acc[r][c] = VFMA(mw[c], sx, acc[r][c]);
            }
        }
    }
    for (int r = 0; r < R; r++)
        for (int c = 0; c < C; c++) VSTORE_F(y + r * N + (u0 + c) * VW, acc[r][c]);
}

// Columns [u0 * VW, u1 * VW) of R rows: tiles of CT vectors, then single vectors.
#define PFX_ROWS_CASE(F, R, CT)                                                                              \
    case R:                                                                                                 \
        for (; u + CT <= u1; u += CT) PFX(tile)(F, R, CT, x, XS, K, w, u, y, N);                            \
        for (; u < u1; u++) PFX(tile)(F, R, 1, x, XS, K, w, u, y, N);                                       \
        break;

// Every row count 1..RMAX needs its case (a missing one would compute nothing), no tile wider than CMAX vectors.
#define PFX_TILE_BIT(F, R, CT) | (1ull << (R)) | ((CT) > CMAX ? 1ull : 0)
_Static_assert((0 TILES(PFX_TILE_BIT, 0)) == (2ull << RMAX) - 2, "TILES must list row counts 1..RMAX, CT <= CMAX");
#undef PFX_TILE_BIT

static inline __attribute__((always_inline)) void PFX(rows)(const int F, int64_t R, const uint8_t *x, int64_t XS,
                                                            int64_t K, const uint8_t *w, int64_t u0, int64_t u1,
                                                            float *y, int64_t N) {
    int64_t u = u0;
    switch (R) { TILES(PFX_ROWS_CASE, F) }
}

// Rows [0, R) x vectors [u0, u1): as few register tiles as RMAX allows (each one expands the weights again), their
// rows as even as possible (9 rows with RMAX 8: 5 + 4, not 8 + 1).
static inline __attribute__((always_inline)) void PFX(row_tiles)(const int F, int64_t R, const uint8_t *x,
                                                                 int64_t XS, int64_t K, const uint8_t *w, int64_t u0,
                                                                 int64_t u1, float *y, int64_t N) {
    for (int64_t r = 0, n, left = (R + RMAX - 1) / RMAX; r < R; r += n, left--) {
        n = (R - r + left - 1) / left;
        PFX(rows)(F, n, x + r * XS, XS, K, w, u0, u1, y + r * N, N);
    }
}

// y [M, N] = x [M, K] @ W^T: the threads quantize the rows into xq (M rows of ROW_BYTES(K)), then each takes a
// contiguous share of the column groups and sweeps it TILE_M rows at a time (the share's weights stay in its caches).
static void PFX(gemm)(const int F, const float *x, uint8_t *xq, int64_t M, int64_t K, const uint8_t *w, int64_t N,
                      float *y, int nthreads) {
    const int64_t groups = N / GROUP, per = GROUP / VW, XS = ROW_BYTES(K);
#pragma omp parallel num_threads(nthreads)
    {
#pragma omp for schedule(static)
        for (int64_t m = 0; m < M; m++) quantize_row(x + m * K, K, xq + m * XS);
        const int64_t t = omp_get_thread_num(), T = omp_get_num_threads();
        const int64_t g0 = groups * t / T, g1 = groups * (t + 1) / T;
        for (int64_t m0 = 0; m0 < M; m0 += TILE_M) {
            const int64_t m1 = M < m0 + TILE_M ? M : m0 + TILE_M;
            for (int64_t g = g0; g < g1; g += COL_GROUPS) {
                const int64_t ge = g + COL_GROUPS < g1 ? g + COL_GROUPS : g1;
                if (F == Q4V)
                    PFX(row_tiles)(Q4V, m1 - m0, xq + m0 * XS, XS, K, w, g * per, ge * per, y + m0 * N, N);
                else if (F == Q8V)
                    PFX(row_tiles)(Q8V, m1 - m0, xq + m0 * XS, XS, K, w, g * per, ge * per, y + m0 * N, N);
                else if (F == Q6V)
                    PFX(row_tiles)(Q6V, m1 - m0, xq + m0 * XS, XS, K, w, g * per, ge * per, y + m0 * N, N);
                else if (F == Q4KV)
                    PFX(row_tiles)(Q4KV, m1 - m0, xq + m0 * XS, XS, K, w, g * per, ge * per, y + m0 * N, N);
                else if (F == Q6KV)
                    PFX(row_tiles)(Q6KV, m1 - m0, xq + m0 * XS, XS, K, w, g * per, ge * per, y + m0 * N, N);
                else
                    PFX(row_tiles)(Q5V, m1 - m0, xq + m0 * XS, XS, K, w, g * per, ge * per, y + m0 * N, N);
            }
        }
    }
}

#undef PFX
#undef VW
#undef vi
#undef vf
#undef VZERO_I
#undef VSET1_I
#undef VSET1_F
#undef VLOAD_I
#undef VLOAD_F
#undef VSTORE_F
#undef VAND
#undef VOR
#undef VSRL16
#undef VSLL16
#undef VLOAD_H
#undef VLOAD_U8
#undef VLOAD_S8
#undef VDP
#undef VDP_Q8
#undef Q8_INIT
#undef VDP2
#undef VCVT
#undef VMUL
#undef VFMA
#undef RMAX
#undef CMAX
#undef TILES
