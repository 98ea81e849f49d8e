// The 256-bit (ymm) parameters of qgemm_i8_vnni.h that the AVX-VNNI and AVX2 variants share: 8 columns per vector,
// 16 registers. Each variant adds its PFX, dot-product macros and register tiles (RMAX, CMAX, TILES).
#define VW 8
#define vi __m256i
#define vf __m256
#define VZERO_I() _mm256_setzero_si256()
#define VSET1_I(v) _mm256_set1_epi32(v)
#define VSET1_F(v) _mm256_set1_ps(v)
#define VLOAD_I(p) _mm256_loadu_si256((const __m256i *)(p))
#define VLOAD_F(p) _mm256_loadu_ps(p)
#define VSTORE_F(p, v) _mm256_storeu_ps(p, v)
#define VAND(a, b) _mm256_and_si256(a, b)
#define VSRL16(a, n) _mm256_srli_epi16(a, n)
#define VSLL16(a, n) _mm256_slli_epi16(a, n)
#define VOR(a, b) _mm256_or_si256(a, b)
#define VLOAD_H(p) _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(p)))
#define VLOAD_U8(p) _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(p))))
#define VLOAD_S8(p) _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(p))))
#define VCVT(a) _mm256_cvtepi32_ps(a)
#define VMUL(a, b) _mm256_mul_ps(a, b)
#define VFMA(a, b, c) _mm256_fmadd_ps(a, b, c)
