// A run of Llama-style decoder layers in one call: the kernels of qgemm.c and ops.c, called in the order and with
// the arguments the PyTorch module code (verispec/models/decoder.py) gives them, minus ~30 Python-level ops per
// layer. Every value is computed by the same C function as on the module path, so both paths are bitwise equal
// (tests/models/kernels/test_fused_layers.py) and a row's result still never depends on the other rows.
//
// Layer l, on the N packed rows (the real tokens; pack[i] is row i's place in the padded [S, Q] layout, row s * Q + t
// being token t of sequence s; qlen[s]: sequence s's rows, 0 .. qlen[s] - 1 of the layout; both NULL: N = S * Q, no
// padding). Projections, norms and the MLP see the N rows;
// RoPE, the KV write and attention work on the padded layout (qkv scattered into it, attention gathered back), on its
// real rows only (a batch verifying one request's drafts pads every other sequence to that request's rows):
//   normed = rmsnorm(h) * norm_in                 (fused with the previous layer's residual add)
//   qkv = normed @ Wqkv^T (+ b); RoPE on the q and k heads; K|V written to the cache at cache_pos
//   h += attention(q, cache) @ Wo^T; normed = rmsnorm(h) * norm_post
//   h += (silu(normed @ Wg^T) * (normed @ Wu^T)) @ Wd^T
// Under tensor parallelism each rank holds some heads and MLP columns, and the two products added to h are summed
// over the ranks (ModelDims.allreduce) before the add.
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include "kernels.h"

// qgemm_amx.c is in the 'amx' build only (q4t / q8t weights exist only there): NULL elsewhere
#pragma weak qgemm_q4t
#pragma weak qgemm_q8t

typedef struct LayerDesc {
    const uint8_t *w_qkv, *w_o, *w_gate_up, *w_down;  // quantized blocks (qweight.py layouts)
    int32_t f_qkv, f_o, f_gate_up, f_down;             // 0 q4, 1 q8, 2 q4t, 3 q8t, 4 q4v, 5 q8v, 6 q6v, 7 q6, 8 q4kv, 9 q6kv, 10 q5v
    const float *b_qkv;                                // [F] or NULL
    const float *norm_in, *norm_post;                  // [hidden]
    void *kv;                                          // this layer's paged cache [blocks, 2 Hkv, bs, D]
    const uint8_t *w_k, *w_v;  // q, k and v apart (their formats differ): w_qkv holds q's rows; NULL: fused
    int32_t f_k, f_v;
} LayerDesc;

// Tensor parallelism: x [n] summed over the ranks in place (comm.c's shared-memory all-reduce, or a callback)
typedef int32_t (*allreduce_fn)(void *ctx, float *x, int64_t n);

typedef struct ModelDims {
    int64_t hidden, hq, hkv, d, inter;  // under tensor parallelism: this rank's heads and MLP columns
    int64_t cs, ch, ct;                 // paged cache strides in elements (block, head, row)
    float eps, scale, softcap;
    int32_t i8_isa;  // the qgemm_i8 variant for q4v / q8v / q6v / q4kv / q6kv weights (int8 activations)
    allreduce_fn allreduce;  // NULL: one rank; else called on the attention and MLP outputs of every layer
    void *ar_ctx;
    int32_t kv_dtype;  // how the cache stores K and V (KV_F32, KV_F16, KV_BF16)
} ModelDims;

static void qgemm(const ModelDims *m, int32_t fmt, const float *x, int64_t M, int64_t K, const uint8_t *w,
                  int64_t N, float *y, int nt) {
    if (fmt >= 4 && fmt <= 6)
        qgemm_i8(m->i8_isa, fmt - 4, x, M, K, w, N, y, nt);
    else if (fmt >= 8 && fmt <= 10)
        qgemm_i8(m->i8_isa, fmt - 5, x, M, K, w, N, y, nt);
    else if (fmt == 7)
        qgemm_q6(x, M, K, w, N, y, nt);
    else if (fmt == 0)
        qgemm_q4(x, M, K, w, N, y, nt);
    else if (fmt == 1)
        qgemm_q8(x, M, K, w, N, y, nt);
    else if (fmt == 2)
        qgemm_q4t(x, M, K, w, N, y, nt);
    else
        qgemm_q8t(x, M, K, w, N, y, nt);
}

// qkv [N, F] = x @ Wqkv^T: one product, or, with q, k and v kept apart, one each into tmp [N, rows] copied into
// their columns
static void project_qkv(const ModelDims *m, const LayerDesc *L, const float *x, int64_t N, float *qkv, float *tmp,
                        int nt) {
    const int64_t H = m->hidden, D = m->d, F = (m->hq + 2 * m->hkv) * D;
    if (!L->w_k) {
        qgemm(m, L->f_qkv, x, N, H, L->w_qkv, F, qkv, nt);
        return;
    }
    const uint8_t *w[3] = {L->w_qkv, L->w_k, L->w_v};
    const int32_t f[3] = {L->f_qkv, L->f_k, L->f_v};
    const int64_t rows[3] = {m->hq * D, m->hkv * D, m->hkv * D};
    int64_t off = 0;
    for (int p = 0; p < 3; p++) {
        qgemm(m, f[p], x, N, H, w[p], rows[p], tmp, nt);
        for (int64_t n = 0; n < N; n++) memcpy(qkv + n * F + off, tmp + n * rows[p], sizeof(float) * rows[p]);
        off += rows[p];
    }
}

// Scratch floats per padded row (S * Q of them) that decoder_layers_f32 needs (the caller owns the buffer: nothing
// is allocated per step).
int64_t decoder_scratch_per_row(const ModelDims *m) {
    const int64_t F = (m->hq + 2 * m->hkv) * m->d;
    return 2 * m->hidden + 2 * F + 2 * m->hq * m->d + 3 * m->inter;
}

// aux_out[n, j * hidden : (j + 1) * hidden] = row n of the stream entering layer aux_at[j] (aux_at[j] == n_layers:
// the stream after the last layer), for j < n_aux: the states EAGLE-3 drafts from, side by side.
static void copy_aux(const float *h, int64_t N, int64_t H, int64_t l, const int64_t *aux_at, int64_t n_aux,
                     float *aux_out) {
    for (int64_t j = 0; j < n_aux; j++)
        if (aux_at[j] == l)
            for (int64_t n = 0; n < N; n++) memcpy(aux_out + (n * n_aux + j) * H, h + n * H, sizeof(float) * H);
}

// h [N, hidden] in place: the residual stream after layers [0, n_layers) of `layers`. pack [N] and qlen [S] (or both
// NULL: N = S * Q).
// cos / ssin [S, Q, D]; cache_pos [S, Q] positions in each sequence, blocks [S, nbt] its block table (block size
// 1 << bshift); mask [S, 1, Q, kv_len] bool with strides (ms, mq), or NULL;
// scratch: S * Q * decoder_scratch_per_row(m) floats. aux_at [n_aux] layer ids in 0 .. n_layers, aux_out
// [N, n_aux * hidden] (n_aux 0: both may be NULL): the streams entering those layers, copied on the way (copy_aux).
// norm_final [hidden]: the model's final norm, normed_out [N, hidden] = rmsnorm(h) * norm_final, fused with the last
// layer's residual add as between layers (the module path's final RMSNorm calls the same kernel).
void decoder_layers_f32(const LayerDesc *layers, int64_t n_layers, const ModelDims *m, float *h, int64_t S,
                        int64_t Q, const int64_t *pack, const int64_t *qlen, int64_t N, const float *cos,
                        const float *ssin, const int64_t *blocks, int64_t nbt, int64_t bshift,
                        const int64_t *cache_pos, int64_t kv_len,
                        const uint8_t *mask, int64_t ms, int64_t mq, float *scratch, int nthreads,
                        const int64_t *aux_at, int64_t n_aux, float *aux_out, const float *norm_final,
                        float *normed_out) {
    const int64_t P = S * Q, H = m->hidden, D = m->d, hq = m->hq, hkv = m->hkv, I = m->inter;
    const int64_t F = (hq + 2 * hkv) * D, O = hq * D;
    if (!pack) N = P;
    float *normed = scratch, *qkv = normed + N * H, *attn = qkv + N * F, *a = attn + N * O;
    float *gu = a + N * H, *act = gu + N * 2 * I;
    float *qkv_pad = pack ? act + N * I : qkv, *attn_pad = pack ? qkv_pad + P * F : attn;
    if (pack) memset(qkv_pad, 0, sizeof(float) * P * F);  // padding rows: zeros (finite; never read back)
    for (int64_t l = 0; l < n_layers; l++) {
        const LayerDesc *L = layers + l;
        copy_aux(h, N, H, l, aux_at, n_aux, aux_out);
        if (l == 0) add_rmsnorm_f32(h, NULL, L->norm_in, N, H, m->eps, h, normed);
        // attn is free until attention writes it: the parts' products go through it
        project_qkv(m, L, normed, N, qkv, attn, nthreads);
        if (L->b_qkv)
            for (int64_t n = 0; n < N; n++)
                for (int64_t f = 0; f < F; f++) qkv[n * F + f] += L->b_qkv[f];
        if (pack)
            for (int64_t n = 0; n < N; n++) memcpy(qkv_pad + pack[n] * F, qkv + n * F, sizeof(float) * F);
        rope_f32(qkv_pad, S, hq + hkv, Q, D, Q * F, D, F, cos, ssin, qlen);
        char *cache = L->kv;
        write_kv_f32(cache, m->cs, m->ch, m->ct, qkv_pad + hq * D, Q * F, D, F, cache_pos, S, 2 * hkv, Q, D, qlen,
                     blocks, nbt, bshift, m->kv_dtype);
        // V heads follow the K heads: hkv head strides of kv_dtype's elements further
        const char *vcache = cache + hkv * m->ch * (m->kv_dtype == KV_F32 ? 4 : 2);
        attention_f32(qkv_pad, S, hq, Q, D, Q * F, D, F, cache, vcache, hkv, kv_len, m->cs, m->ch, m->ct, blocks,
                      nbt, bshift, mask, ms, mq, m->scale, m->softcap, attn_pad, qlen, nthreads, m->kv_dtype);
        if (pack)
            for (int64_t n = 0; n < N; n++) memcpy(attn + n * O, attn_pad + pack[n] * O, sizeof(float) * O);
        qgemm(m, L->f_o, attn, N, O, L->w_o, H, a, nthreads);
        if (m->allreduce) m->allreduce(m->ar_ctx, a, N * H);
        add_rmsnorm_f32(h, a, L->norm_post, N, H, m->eps, h, normed);
        qgemm(m, L->f_gate_up, normed, N, H, L->w_gate_up, 2 * I, gu, nthreads);
        silu_mul_f32(gu, N, I, act, nthreads);
        qgemm(m, L->f_down, act, N, I, L->w_down, H, a, nthreads);
        if (m->allreduce) m->allreduce(m->ar_ctx, a, N * H);
        // the residual add, fused with the next norm: the next layer's, or the model's final one
        const float *next = l + 1 < n_layers ? layers[l + 1].norm_in : norm_final;
        add_rmsnorm_f32(h, a, next, N, H, m->eps, h, l + 1 < n_layers ? normed : normed_out);
    }
    copy_aux(h, N, H, n_layers, aux_at, n_aux, aux_out);
}
