// Vector math shared by the native CPU kernels (the attention kernel's softmax, the matmul's
// gated-activation epilogue). The build (`pallas_kernels/_native_cpu.py`) puts this folder on
// the include path and keys its cache on these headers too.
#pragma once

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#include <immintrin.h>
#endif

namespace jaxserve_native {

// exp(x) to ~2 ulp, the vector forms' shared constants (exp16, exp8): x clamped to [kLo, kHi]
// (2^n stays a normal float), n = round(x * log2(e)), r = x - n ln2 with ln2 in two parts,
// exp(r) from Cephes' degree-7 polynomial (kPoly, highest power first, then r^2 * p + r + 1),
// scaled by 2^n.
struct ExpPoly {
  static constexpr float kLo = -87.3f, kHi = 88.3f, kLog2e = 1.44269504f;
  static constexpr float kLn2Hi = 0.693359375f, kLn2Lo = -2.12194440e-4f;
  static constexpr float kPoly[6] = {1.9875691500e-4f, 1.3981999507e-3f, 8.3334519073e-3f,
                                     4.1665795894e-2f, 1.6666665459e-1f, 5.0000001201e-1f};
};

#if defined(__AVX512F__)
// exp(x) to ~2 ulp (ExpPoly), 16 lanes; 2^n applied by scalef.
inline __m512 exp16(__m512 x) {
  using E = ExpPoly;
  x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(E::kLo)), _mm512_set1_ps(E::kHi));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(E::kLog2e)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(E::kLn2Hi), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(E::kLn2Lo), r);
  __m512 p = _mm512_set1_ps(E::kPoly[0]);
  for (int i = 1; i < 6; ++i) p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(E::kPoly[i]));
  p = _mm512_fmadd_ps(_mm512_mul_ps(p, r), r, _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
  return _mm512_scalef_ps(p, n);
}
#endif

#if defined(__AVX2__) && defined(__FMA__)
// exp(x) to ~2 ulp (ExpPoly), 8 lanes; 2^n built in the exponent field.
inline __m256 exp8(__m256 x) {
  using E = ExpPoly;
  x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(E::kLo)), _mm256_set1_ps(E::kHi));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(E::kLog2e)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(E::kLn2Hi), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(E::kLn2Lo), r);
  __m256 p = _mm256_set1_ps(E::kPoly[0]);
  for (int i = 1; i < 6; ++i) p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(E::kPoly[i]));
  p = _mm256_fmadd_ps(_mm256_mul_ps(p, r), r, _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}
#endif

}  // namespace jaxserve_native
