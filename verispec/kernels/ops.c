// Fused decode-path operations the model would otherwise spend several PyTorch ops (and their dispatch) on:
// attention over the slot-major KV cache, residual add + RMSNorm, SiLU(gate) * up. Float32, x86-64 AVX2 + FMA.
// Every result is computed per row in a fixed order, independent of how many rows are in the call.
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

static inline float hsum8(__m256 v) {
    const __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    const __m128 t = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(t, _mm_movehdup_ps(t)));
}

static inline float dot(const float *a, const float *b, int64_t n) {  // n % 8 == 0
    __m256 acc = _mm256_setzero_ps();
    for (int64_t i = 0; i < n; i += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc);
    return hsum8(acc);
}

// q: [S, Hq, Q, D] with strides (qs, qh, qq) in elements, D contiguous; k, v: [S, Hkv, T, D] with strides
// (ks, kh, kt) (the cache view; v shares k's strides); mask: [S, 1, Q, T] bool with strides (ms, mq), T contiguous,
// or NULL (attend to all T). out: [S, Q, Hq, D] contiguous (the layout o_proj reads). D % 8 == 0.
// softcap > 0 applies tanh(score / softcap) * softcap before the mask (Gemma 2 style).
void attention_f32(const float *q, int64_t S, int64_t Hq, int64_t Q, int64_t D, int64_t qs, int64_t qh, int64_t qq,
                   const float *k, const float *v, int64_t Hkv, int64_t T, int64_t ks, int64_t kh, int64_t kt,
                   const uint8_t *mask, int64_t ms, int64_t mq, float scale, float softcap, float *out,
                   int nthreads) {
    const int64_t group = Hq / Hkv, work = S * Hq * Q;
    const int threads = work * T * D >= (1 << 17) ? nthreads : 1;  // small problems: no thread wake-up
#pragma omp parallel num_threads(threads)
    {
        float *p = malloc(sizeof(float) * (T > 0 ? T : 1));
#pragma omp for schedule(static)
        for (int64_t i = 0; i < work; i++) {
            const int64_t s = i / (Hq * Q), h = (i / Q) % Hq, t0 = i % Q, g = h / group;
            const float *qv = q + s * qs + h * qh + t0 * qq;
            const float *kb = k + s * ks + g * kh, *vb = v + s * ks + g * kh;
            const uint8_t *mrow = mask ? mask + s * ms + t0 * mq : NULL;
            float mx = -INFINITY;
            for (int64_t t = 0; t < T; t++) {
                if (mrow && !mrow[t]) {
                    p[t] = -INFINITY;
                    continue;
                }
                float sc = dot(qv, kb + t * kt, D) * scale;
                if (softcap > 0) sc = tanhf(sc / softcap) * softcap;
                p[t] = sc;
                if (sc > mx) mx = sc;
            }
            float *o = out + ((s * Q + t0) * Hq + h) * D;
            for (int64_t d = 0; d < D; d++) o[d] = 0.0f;
            if (mx == -INFINITY) continue;  // nothing to attend to
            float sum = 0.0f;
            for (int64_t t = 0; t < T; t++) {
                const float e = p[t] == -INFINITY ? 0.0f : expf(p[t] - mx);
                p[t] = e;
                sum += e;
            }
            for (int64_t t = 0; t < T; t++) {
                if (p[t] == 0.0f) continue;
                const __m256 w = _mm256_set1_ps(p[t]);
                const float *vt = vb + t * kt;
                for (int64_t d = 0; d < D; d += 8)
                    _mm256_storeu_ps(o + d, _mm256_fmadd_ps(w, _mm256_loadu_ps(vt + d), _mm256_loadu_ps(o + d)));
            }
            const __m256 inv = _mm256_set1_ps(1.0f / sum);
            for (int64_t d = 0; d < D; d += 8) _mm256_storeu_ps(o + d, _mm256_mul_ps(_mm256_loadu_ps(o + d), inv));
        }
        free(p);
    }
}

// sum [N, D] = h + a (a == NULL: sum = h, may alias), out [N, D] = sum * rsqrt(mean(sum^2) + eps) * w. D % 8 == 0.
void add_rmsnorm_f32(const float *h, const float *a, const float *w, int64_t N, int64_t D, float eps, float *sum,
                     float *out) {
    for (int64_t n = 0; n < N; n++) {
        float *x = sum + n * D;
        const float *hx = h + n * D;
        if (a) {
            const float *y = a + n * D;
            for (int64_t d = 0; d < D; d += 8)
                _mm256_storeu_ps(x + d, _mm256_add_ps(_mm256_loadu_ps(hx + d), _mm256_loadu_ps(y + d)));
        }
        const float r = 1.0f / sqrtf(dot(x, x, D) / (float)D + eps);
        const __m256 vr = _mm256_set1_ps(r);
        float *o = out + n * D;
        for (int64_t d = 0; d < D; d += 8)
            _mm256_storeu_ps(o + d, _mm256_mul_ps(_mm256_mul_ps(_mm256_loadu_ps(x + d), vr), _mm256_loadu_ps(w + d)));
    }
}

// gate_up [N, 2I] -> out [N, I] = silu(gate) * up, silu(g) = g / (1 + exp(-g)).
void silu_mul_f32(const float *gate_up, int64_t N, int64_t I, float *out) {
    for (int64_t n = 0; n < N; n++) {
        const float *g = gate_up + n * 2 * I, *u = g + I;
        float *o = out + n * I;
        for (int64_t i = 0; i < I; i++) o[i] = g[i] / (1.0f + expf(-g[i])) * u[i];
    }
}

// In-place rotary embedding on heads [0, H) of x [S, H, Q, D] (strides xs, xh, xq; D contiguous), HF rotate-half
// layout: x <- x * cos + roll(x, D/2) * ssin, with cos / ssin [S, Q, D] contiguous (ssin = cat(-sin, sin)).
void rope_f32(float *x, int64_t S, int64_t H, int64_t Q, int64_t D, int64_t xs, int64_t xh, int64_t xq,
              const float *cos, const float *ssin) {
    const int64_t half = D / 2;
    float tmp[1024];
    for (int64_t s = 0; s < S; s++)
        for (int64_t t = 0; t < Q; t++) {
            const float *c = cos + (s * Q + t) * D, *sn = ssin + (s * Q + t) * D;
            for (int64_t h = 0; h < H; h++) {
                float *v = x + s * xs + h * xh + t * xq;
                for (int64_t i = 0; i < D; i++) tmp[i] = v[i];
                for (int64_t i = 0; i < D; i++) v[i] = tmp[i] * c[i] + tmp[(i + half) % D] * sn[i];
            }
        }
}

// cache[s, h, pos[s, t], :] = x[s, h, t, :] for h < H (cache strides cs, ch, ct; x strides xs, xh, xq; D contiguous).
void write_kv_f32(float *cache, int64_t cs, int64_t ch, int64_t ct, const float *x, int64_t xs, int64_t xh,
                  int64_t xq, const int64_t *pos, int64_t S, int64_t H, int64_t Q, int64_t D) {
    for (int64_t s = 0; s < S; s++)
        for (int64_t t = 0; t < Q; t++) {
            const int64_t p = pos[s * Q + t];
            for (int64_t h = 0; h < H; h++) {
                const float *src = x + s * xs + h * xh + t * xq;
                float *dst = cache + s * cs + h * ch + p * ct;
                for (int64_t i = 0; i < D; i++) dst[i] = src[i];
            }
        }
}
