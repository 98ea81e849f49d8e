// The C interface of verispec's kernel library, declared once: every .c file includes it (the compiler checks each
// definition against it) and verispec/kernels/build.py reads the prototypes below to set the ctypes argument and
// return types (pointers -> c_void_p, int64_t -> c_int64, int32_t -> c_int32, int -> c_int, float -> c_float,
// double -> c_double).
// Keep one prototype per declaration, `;`-terminated; no macros in them.
#ifndef VERISPEC_KERNELS_H
#define VERISPEC_KERNELS_H
#include <stdint.h>

struct LayerDesc;
struct ModelDims;
struct ShmComm;

// qgemm.c: y [M, N] = x [M, K] @ W^T, float32 activations, W in the q4 / q8 / q6 layouts of
// verispec/kernels/qweight.py.
void qgemm_q4(const float *x, int64_t M, int64_t K, const uint8_t *w, int64_t N, float *y, int nthreads);
void qgemm_q8(const float *x, int64_t M, int64_t K, const uint8_t *w, int64_t N, float *y, int nthreads);
void qgemm_q6(const float *x, int64_t M, int64_t K, const uint8_t *w, int64_t N, float *y, int nthreads);

// qgemm_i8.c: the same product with int8 activations (isa: 1 AVX-VNNI, 2 AVX512-VNNI, 3 AMX-INT8, 4 AVX2; fmt: 0 q4v,
// 1 q8v, 2 q6v, 3 q4kv, 4 q6kv, 5 q5v); qgemm_i8_isas: bit isa set for each variant this build holds; quantize_rows_i8: the activation
// quantization alone (tests), M rows of K + 20 * K / 32 bytes; i8_amx_init: 1 if the OS grants the tile state.
void qgemm_i8(int isa, int fmt, const float *x, int64_t M, int64_t K, const uint8_t *w, int64_t N, float *y,
              int nthreads);
int qgemm_i8_isas(void);
void quantize_rows_i8(const float *x, int64_t M, int64_t K, uint8_t *out, int nthreads);
int i8_amx_init(void);

// ops.c: fused decoder ops (shapes and strides documented there). kv_dtype: how the KV cache stores K and V.
enum { KV_F32 = 0, KV_F16 = 1, KV_BF16 = 2 };
void attention_f32(const float *q, int64_t S, int64_t Hq, int64_t Q, int64_t D, int64_t qs, int64_t qh, int64_t qq,
                   const void *k, const void *v, int64_t Hkv, int64_t T, int64_t ks, int64_t kh, int64_t kt,
                   const int64_t *blocks, int64_t nbt, int64_t bshift, const uint8_t *mask, int64_t ms, int64_t mq,
                   float scale, float softcap, float *out, const int64_t *qlen, int nthreads, int32_t kv_dtype);
void add_rmsnorm_f32(const float *h, const float *a, const float *w, int64_t N, int64_t D, float eps, float *sum,
                     float *out);
void silu_mul_f32(const float *gate_up, int64_t N, int64_t I, float *out, int nthreads);
void rope_f32(float *x, int64_t S, int64_t H, int64_t Q, int64_t D, int64_t xs, int64_t xh, int64_t xq,
              const float *cos, const float *ssin, const int64_t *qlen);
void write_kv_f32(void *cache, int64_t cs, int64_t ch, int64_t ct, const float *x, int64_t xs, int64_t xh,
                  int64_t xq, const int64_t *pos, int64_t S, int64_t H, int64_t Q, int64_t D,
                  const int64_t *qlen, const int64_t *blocks, int64_t nbt, int64_t bshift, int32_t kv_dtype);
void argmax_rows_f32(const float *x, int64_t N, int64_t V, int64_t stride, int64_t *out, int nthreads);
void apply_bitmask_f32(float *x, int64_t V, int64_t stride, const int32_t *mask, int64_t W, const int64_t *rows,
                       int64_t R);
void verify_greedy_f32(const float *x, int64_t V, int64_t stride, int64_t B, int64_t K, const int64_t *rows,
                       const int64_t *drafts, int64_t *out_token, int64_t *num_accepted, int nthreads);
void verify_sampled_f32(const float *x, int64_t V, int64_t stride, int64_t B, int64_t K, const int64_t *rows,
                        const int64_t *drafts, const float *scale, const float *u_accept, const float *u_sample,
                        int64_t *out_token, int64_t *num_accepted, int nthreads);

// layers.c: a run of decoder layers in one call.
int64_t decoder_scratch_per_row(const struct ModelDims *m);
void decoder_layers_f32(const struct LayerDesc *layers, int64_t n_layers, const struct ModelDims *m, float *h,
                        int64_t S, int64_t Q, const int64_t *pack, const int64_t *qlen, int64_t N,
                        const float *cos, const float *ssin, const int64_t *blocks, int64_t nbt, int64_t bshift,
                        const int64_t *cache_pos,
                        int64_t kv_len, const uint8_t *mask, int64_t ms, int64_t mq, float *scratch, int nthreads,
                        const int64_t *aux_at, int64_t n_aux, float *aux_out, const float *norm_final,
                        float *normed_out);

// repack.c: GGUF blocks into the layouts of verispec/kernels/qweight.py at load time (Q4_K -> q4, Q6_K -> q6,
// q4 -> q4t, q8 -> q8t, q4 / q8 / q6 -> q4v / q8v / q6v, q4 / q6 -> q4kv / q6kv where the scales factor, q8 -> q5v where q fits 5 bits; nsb super-blocks of 256 weights, nb blocks of 32 per row) and q4 / q8 / q6 rows back to
// float32 (fmt: 0 q4, 1 q8, 2 q6): all N rows, or M chosen rows (an embedding lookup; -> -1, or the index of the
// first row outside [0, N), then nothing is written).
void repack_q4k(const uint8_t *src, int64_t N, int64_t nsb, uint8_t *dst, int nthreads);
void repack_q6k(const uint8_t *src, int64_t N, int64_t nsb, uint8_t *dst, int nthreads);
void tile_q4(const uint8_t *src, int64_t N, int64_t nb, uint8_t *dst, int nthreads);
void tile_q8(const uint8_t *src, int64_t N, int64_t nb, uint8_t *dst, int nthreads);
void int8_layout(int fmt, const uint8_t *src, int64_t N, int64_t nb, uint8_t *dst, int nthreads);
int64_t int8_compact(int fmt, const uint8_t *src, int64_t N, int64_t nb, uint8_t *dst, int nthreads);
int64_t int8_q5(const uint8_t *src, int64_t N, int64_t nb, uint8_t *dst, int nthreads);
void dequant_rows(int fmt, const uint8_t *src, int64_t N, int64_t nb, float *dst, int nthreads);
int64_t dequant_gather(int fmt, const uint8_t *src, int64_t N, int64_t nb, const int64_t *rows, int64_t M,
                       float *dst);

// comm.c: the shared-memory channel of tensor-parallel ranks on one machine (verispec/kernels/comm.py). Each op is a
// barrier of all ranks and returns 0, -1 (a peer died or the timeout passed) or -2 (the channel was closed);
// shm_comm_init returns 0, or -3 when the segment is not one of this world and cap.
int64_t shm_comm_size(void);
int64_t shm_segment_bytes(int64_t world, int64_t cap);
int32_t shm_comm_init(struct ShmComm *c, void *base, int32_t rank, int32_t world, int64_t cap, double timeout_s,
                      int32_t create);
int32_t shm_comm_dead_rank(void *c);
int32_t shm_allreduce_f32(void *c, float *x, int64_t n);
int32_t shm_gather_f32(void *c, const float *x, int64_t rows, int64_t width, float *out, int64_t out_stride,
                       int64_t col);
int32_t shm_broadcast(void *c, void *data, int64_t nbytes, double timeout_s);
int32_t shm_barrier(void *c);
void shm_close(void *c);

// qgemm_amx.c, in the 'amx' build only (AMX-BF16 tiles, float32 activations; q4t / q8t weights).
int amx_init(void);
void qgemm_q4t(const float *x, int64_t M, int64_t K, const uint8_t *w, int64_t N, float *y, int nthreads);
void qgemm_q8t(const float *x, int64_t M, int64_t K, const uint8_t *w, int64_t N, float *y, int nthreads);
#endif
