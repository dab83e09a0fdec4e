// Ragged paged attention for XLA:CPU, as an XLA FFI custom call.
//
// XLA:CPU turns the attention of a decode batch (per sequence: 1-8 query heads per KV head
// against a few hundred keys) into tiny reductions it runs at 3-5 GB/s of K/V; this kernel
// walks each sequence's live pages once, all heads together, and reaches the memory
// bandwidth. Same contract as `reference.py` (heads-layout pages [P, S, Hkv, D]): token j of
// sequence i sits at position kv_lens[i] - q_len_i + j and attends to keys k <= p (and
// p - k < sliding_window, an operand so that it may differ per layer of one scan; <= 0 is no
// window); logits q.k * sm_scale, optionally soft-capped; an `attend_until` operand [T]
// raises token t's last key to min(max(p, attend_until[t]), kv_len - 1) (Gemma 3's image
// tokens see their whole image; the window's lowest key still follows from p); rows past
// cu_q_lens[num_seqs] are zero. Page ids and lengths are clamped to the buffers, so bad
// metadata gives wrong numbers, never an out-of-bounds read.
//
// Work is split into items (one sequence, a block of up to kQueryBlock of its query tokens,
// every head) that the calling thread and XLA's intra-op pool take from a shared counter.
//
// Quantized pages (int8, float8_e4m3fn, float8_e5m2; pallas_kernels/kv_quant.py) come with one
// f32 scale per token and KV head ([P, S, Hkv]): a key's scores are q.k_raw * k_scale, and each
// softmax weight is multiplied by its key's v_scale before P.V, so values are widened on load
// and never written back dequantized. fp8 is widened exactly through f16 (e5m2 is the upper
// byte of an f16; e4m3fn's 7 low bits shifted into an f16 are the value / 256, a factor folded
// into the scale).

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <thread>
#include <type_traits>
#include <vector>

#include "vec_math.h"
#include "xla/ffi/api/ffi.h"

#if defined(__AVX512F__)
#include <immintrin.h>
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define RPA_AVX2 1  // 8-lane versions of the segment scores, softmax and P.V (no AVX-512)
#include <immintrin.h>
#endif

namespace ffi = xla::ffi;

namespace {

#if defined(__AVX512F__)
using jaxserve_native::exp16;
#elif defined(RPA_AVX2)
using jaxserve_native::exp8;
#endif

constexpr int64_t kQueryBlock = 8;  // query tokens of one sequence that share each K/V row
constexpr int64_t kPagesAhead = 3;  // K/V pages prefetched into L2 ahead of the one being read
constexpr int64_t kLanes = 16;      // scratch rows are padded to this many floats
constexpr float kMasked = -1e30f;   // finite "minus infinity", as in the reference

inline float to_f32(float x) { return x; }
inline float to_f32(uint16_t x) {  // bfloat16 bits
  const uint32_t b = static_cast<uint32_t>(x) << 16;
  float f;
  std::memcpy(&f, &b, 4);
  return f;
}
inline void store(float x, float* out) { *out = x; }
inline void store(float x, uint16_t* out) {  // round to nearest even; NaN stays NaN
  uint32_t b;
  std::memcpy(&b, &x, 4);
  if ((b & 0x7fffffffu) > 0x7f800000u) {
    *out = 0x7fc0;
    return;
  }
  b += 0x7fffu + ((b >> 16) & 1u);
  *out = static_cast<uint16_t>(b >> 16);
}

// fp8 page elements (their bits); int8 pages are int8_t.
struct E4M3 { uint8_t b; };
struct E5M2 { uint8_t b; };

template <typename KV> struct Quant { static constexpr bool value = false; };
template <> struct Quant<int8_t> { static constexpr bool value = true; };
template <> struct Quant<E4M3> { static constexpr bool value = true; };
template <> struct Quant<E5M2> { static constexpr bool value = true; };
// What a widened element must be multiplied by (besides its scale) to give its value.
template <typename KV> constexpr float decode_factor() { return 1.0f; }
template <> constexpr float decode_factor<E4M3>() { return 256.0f; }

// f16 bits -> f32, exact (subnormals, inf, NaN).
inline float half_to_f32(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16, exp = (h >> 10) & 0x1fu, man = h & 0x3ffu;
  uint32_t bits;
  if (exp == 0x1f) {
    bits = sign | 0x7f800000u | (man << 13);
  } else if (exp != 0) {
    bits = sign | ((exp + 112) << 23) | (man << 13);
  } else {
    const float f = static_cast<float>(man) * (1.0f / 16777216.0f);  // man * 2^-24
    std::memcpy(&bits, &f, 4);
    bits |= sign;
  }
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}
// The f16 whose value is an e4m3fn byte's value / 256 (NaN for 0x7f / 0xff).
inline uint16_t e4m3_as_half(uint8_t b) {
  if ((b & 0x7fu) == 0x7fu) return static_cast<uint16_t>(((b & 0x80u) << 8) | 0x7e00u);
  return static_cast<uint16_t>(((b & 0x80u) << 8) | ((b & 0x7fu) << 7));
}
inline float to_f32(int8_t x) { return static_cast<float>(x); }
inline float to_f32(E5M2 x) { return half_to_f32(static_cast<uint16_t>(x.b) << 8); }
inline float to_f32(E4M3 x) { return half_to_f32(e4m3_as_half(x.b)); }  // value / 256

inline int64_t round_up(int64_t x, int64_t m) { return (x + m - 1) / m * m; }

#if defined(__AVX512F__)
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const uint16_t* p) {
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
inline __m512 load16(const int8_t* p) {
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}
inline __m512 load16(const E5M2* p) {  // the byte is an f16's upper half
  const __m256i b = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm512_cvtph_ps(_mm256_slli_epi16(b, 8));
}
inline __m512 load16(const E4M3* p) {  // value / 256, as to_f32(E4M3)
  const __m256i b = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  const __m256i low = _mm256_and_si256(b, _mm256_set1_epi16(0x7f));
  __m256i h = _mm256_or_si256(_mm256_slli_epi16(_mm256_and_si256(b, _mm256_set1_epi16(0x80)), 8),
                              _mm256_slli_epi16(low, 7));
  const __m256i nan = _mm256_cmpeq_epi16(low, _mm256_set1_epi16(0x7f));
  h = _mm256_or_si256(h, _mm256_and_si256(nan, _mm256_set1_epi16(0x7e00)));
  return _mm512_cvtph_ps(h);
}

#endif

#if defined(__AVX512F__)
// acc rows += sum_j w_j * v_j for NG rows of one KV head given by their indices (acc row at
// acc + r * stride, weights at w + r * w_stride), V rows `v_stride` apart: per 16-lane slice
// of D the accumulators stay in registers across the keys. Each row's FMAs run in key order
// whatever its companions, so its bits do not depend on them; one V load (and widening)
// serves up to 8 rows (the block's tokens share the keys).
template <int NG, typename KV>
inline void pv_rows_avx512(float* acc, int64_t stride, const float* w, int64_t w_stride, const int64_t* r,
                           const KV* v, int64_t v_stride, int64_t n, int64_t D) {
  const float* wr[NG];
  for (int g = 0; g < NG; ++g) wr[g] = w + r[g] * w_stride;
  for (int64_t d = 0; d < D; d += 16) {
    __m512 a[NG];
    for (int g = 0; g < NG; ++g) a[g] = _mm512_loadu_ps(acc + r[g] * stride + d);
    for (int64_t j = 0; j < n; ++j) {
      const __m512 vv = load16(v + j * v_stride + d);
      for (int g = 0; g < NG; ++g) a[g] = _mm512_fmadd_ps(_mm512_set1_ps(wr[g][j]), vv, a[g]);
    }
    for (int g = 0; g < NG; ++g) _mm512_storeu_ps(acc + r[g] * stride + d, a[g]);
  }
}
#endif

#if defined(__AVX512F__)
// Lane L of the result is op over a[L]'s 16 lanes, combined in the same tree as
// _mm512_reduce_add_ps (lanes i + i+8, then i + i+4, i + i+2, i + i+1): 16 vectors reduced
// at once for ~3 instructions each instead of ~9. Each lane's bits depend only on its own
// vector, never on which vectors share the call, so a token's scores (and softmax sums) are
// the same in any block.
template <typename Op>
inline __m512 reduce_16x16(const __m512* a, Op op) {
  __m512 t[8], u[4], w[2];
  for (int k = 0; k < 8; ++k)  // [a.lo8 op a.hi8 | b.lo8 op b.hi8]
    t[k] = op(_mm512_shuffle_f32x4(a[2 * k], a[2 * k + 1], _MM_SHUFFLE(1, 0, 1, 0)),
              _mm512_shuffle_f32x4(a[2 * k], a[2 * k + 1], _MM_SHUFFLE(3, 2, 3, 2)));
  for (int k = 0; k < 4; ++k)  // quarter m: vector 4k+m's lanes i op i+4
    u[k] = op(_mm512_shuffle_f32x4(t[2 * k], t[2 * k + 1], _MM_SHUFFLE(2, 0, 2, 0)),
              _mm512_shuffle_f32x4(t[2 * k], t[2 * k + 1], _MM_SHUFFLE(3, 1, 3, 1)));
  for (int k = 0; k < 2; ++k)  // per quarter: lanes i op i+2 of two vectors
    w[k] = op(_mm512_shuffle_ps(u[2 * k], u[2 * k + 1], _MM_SHUFFLE(1, 0, 1, 0)),
              _mm512_shuffle_ps(u[2 * k], u[2 * k + 1], _MM_SHUFFLE(3, 2, 3, 2)));
  const __m512 r = op(_mm512_shuffle_ps(w[0], w[1], _MM_SHUFFLE(2, 0, 2, 0)),
                      _mm512_shuffle_ps(w[0], w[1], _MM_SHUFFLE(3, 1, 3, 1)));
  // r's lane 4m + c holds vector 4c + m's result.
  return _mm512_permutexvar_ps(_mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15), r);
}
inline __m512 reduce_add_16x16(const __m512* a) {
  return reduce_16x16(a, [](__m512 x, __m512 y) { return _mm512_add_ps(x, y); });
}
inline __m512 reduce_max_16x16(const __m512* a) {
  return reduce_16x16(a, [](__m512 x, __m512 y) { return _mm512_max_ps(x, y); });
}

// Lane j: q . k_j for up to 16 f32 keys (rows `k_stride` apart; lanes >= jn repeat key jn-1).
// Each product is accumulated over D in 16-lane FMAs, then reduced by reduce_add_16x16.
// A whole group of 16 walks its keys by pointer increments (the clamp, computed per FMA, had
// doubled the loop's instructions; 1.05-1.2x on the kernel, decode and prefill, same bits).
inline __m512 scores16(const float* q, const float* k, int64_t k_stride, int64_t jn, int64_t D) {
  __m512 a[16];
  for (int j = 0; j < 16; ++j) a[j] = _mm512_setzero_ps();
  if (jn == 16) {
    for (int64_t d = 0; d < D; d += 16) {
      const __m512 qv = _mm512_loadu_ps(q + d);
      const float* kj = k + d;
      for (int j = 0; j < 16; ++j, kj += k_stride) a[j] = _mm512_fmadd_ps(qv, _mm512_loadu_ps(kj), a[j]);
    }
  } else {
    for (int64_t d = 0; d < D; d += 16) {
      const __m512 qv = _mm512_loadu_ps(q + d);
      for (int j = 0; j < 16; ++j)
        a[j] = _mm512_fmadd_ps(qv, _mm512_loadu_ps(k + (j < jn ? j : jn - 1) * k_stride + d), a[j]);
    }
  }
  return reduce_add_16x16(a);
}

// Lanes [lo, hi] of 16 (empty when hi < lo).
inline __mmask16 lane_range(int64_t lo, int64_t hi) {
  lo = std::max<int64_t>(lo, 0);
  hi = std::min<int64_t>(hi, 15);
  if (hi < lo) return 0;
  return static_cast<__mmask16>(((1u << (hi + 1)) - 1u) & ~((1u << lo) - 1u));
}
#endif

#if defined(RPA_AVX2)
// ---- AVX2 + FMA (no AVX-512): the same segment paths, 8 lanes wide ----
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const uint16_t* p) {
  const __m256i h = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(h, 16));
}
inline __m256 load8(const int8_t* p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}
inline __m256 load8(const E5M2* p) {  // the byte is an f16's upper half
  const __m128i b = _mm_cvtepu8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
  return _mm256_cvtph_ps(_mm_slli_epi16(b, 8));
}
inline __m256 load8(const E4M3* p) {  // value / 256, as to_f32(E4M3)
  const __m128i b = _mm_cvtepu8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
  const __m128i low = _mm_and_si128(b, _mm_set1_epi16(0x7f));
  __m128i h = _mm_or_si128(_mm_slli_epi16(_mm_and_si128(b, _mm_set1_epi16(0x80)), 8), _mm_slli_epi16(low, 7));
  const __m128i nan = _mm_cmpeq_epi16(low, _mm_set1_epi16(0x7f));
  h = _mm_or_si128(h, _mm_and_si128(nan, _mm_set1_epi16(0x7e00)));
  return _mm256_cvtph_ps(h);
}

// Lanes [0, count) of 8 set (all bits), the rest clear: a maskload / maskstore mask.
inline __m256i lanes8(int64_t count) {
  const __m256i idx = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  return _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int32_t>(std::clamp<int64_t>(count, 0, 8))), idx);
}

// Lane j: the sum of a[j]'s 8 lanes, in one fixed tree per lane (so a score's bits depend only
// on its own products, not on its companions).
inline __m256 reduce_add_8x8(const __m256* a) {
  const __m256 t0 = _mm256_hadd_ps(a[0], a[1]), t1 = _mm256_hadd_ps(a[2], a[3]);
  const __m256 t2 = _mm256_hadd_ps(a[4], a[5]), t3 = _mm256_hadd_ps(a[6], a[7]);
  const __m256 u0 = _mm256_hadd_ps(t0, t1), u1 = _mm256_hadd_ps(t2, t3);
  return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}

// Lane j: q . k_j for up to 8 f32 keys (rows `k_stride` apart; lanes >= jn repeat key jn-1).
inline __m256 scores8(const float* q, const float* k, int64_t k_stride, int64_t jn, int64_t D) {
  __m256 a[8];
  for (int j = 0; j < 8; ++j) a[j] = _mm256_setzero_ps();
  for (int64_t d = 0; d < D; d += 8) {
    const __m256 qv = _mm256_loadu_ps(q + d);
    for (int j = 0; j < 8; ++j)
      a[j] = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k + (j < jn ? j : jn - 1) * k_stride + d), a[j]);
  }
  return reduce_add_8x8(a);
}

// pv_rows_avx512 in 8-lane slices of D.
template <int NG, typename KV>
inline void pv_rows_avx2(float* acc, int64_t stride, const float* w, int64_t w_stride, const int64_t* r,
                         const KV* v, int64_t v_stride, int64_t n, int64_t D) {
  const float* wr[NG];
  for (int g = 0; g < NG; ++g) wr[g] = w + r[g] * w_stride;
  for (int64_t d = 0; d < D; d += 8) {
    __m256 a[NG];
    for (int g = 0; g < NG; ++g) a[g] = _mm256_loadu_ps(acc + r[g] * stride + d);
    for (int64_t j = 0; j < n; ++j) {
      const __m256 vv = load8(v + j * v_stride + d);
      for (int g = 0; g < NG; ++g) a[g] = _mm256_fmadd_ps(_mm256_broadcast_ss(wr[g] + j), vv, a[g]);
    }
    for (int g = 0; g < NG; ++g) _mm256_storeu_ps(acc + r[g] * stride + d, a[g]);
  }
}
#endif

// out[g] = q[g] . k for the g < G query heads of one KV head (q rows `stride` apart): the
// portable path (AVX-512 with D % 16 == 0 takes `segment_scores`, AVX2 with D % 8 == 0
// `segment_scores_avx2`).
template <typename KV>
inline void dots(const float* q, int64_t stride, const KV* k, int64_t G, int64_t D, float* out) {
  for (int64_t g = 0; g < G; ++g) {
    float part[kLanes] = {};
    int64_t d = 0;
    for (; d + kLanes <= D; d += kLanes)
      for (int64_t i = 0; i < kLanes; ++i) part[i] += q[g * stride + d + i] * to_f32(k[d + i]);
    float s = 0.0f;
    for (; d < D; ++d) s += q[g * stride + d] * to_f32(k[d]);
    for (int64_t i = 0; i < kLanes; ++i) s += part[i];
    out[g] = s;
  }
}

// acc[g] += sum_j w[g][j] * v_j for the g < G rows of one KV head over n keys: the portable
// path (AVX-512 with D % 16 == 0, or AVX2 with D % 8 == 0, takes `segment_pv`).
template <typename KV>
inline void pv(float* acc, int64_t stride, const float* w, int64_t w_stride, const KV* v, int64_t v_stride,
               int64_t n, int64_t G, int64_t D) {
  for (int64_t g = 0; g < G; ++g)
    for (int64_t j = 0; j < n; ++j)
      for (int64_t d = 0; d < D; ++d) acc[g * stride + d] += w[g * w_stride + j] * to_f32(v[j * v_stride + d]);
}

// Online-softmax update of one score row over a segment of n keys: returns the row's
// weights in place (0 where masked) and the factor its accumulator must be scaled by.
inline float softmax_update(float* s, int64_t n, float* m, float* l) {
  float mx = *m;
  for (int64_t j = 0; j < n; ++j) mx = std::max(mx, s[j]);
  const float alpha = std::exp(*m - mx);
  float sum = 0.0f;
  int64_t j = 0;
#if defined(__AVX512F__)
  const __m512 vmx = _mm512_set1_ps(mx), half = _mm512_set1_ps(0.5f * kMasked);
  __m512 vsum = _mm512_setzero_ps();
  // The tail is a masked vector too: a key's weight and its place in the sum do not depend on
  // where the segment ends (a block of later tokens reads more of the page, masked).
  for (; j < n; j += 16) {
    const __mmask16 in = lane_range(0, n - j - 1);
    const __m512 x = _mm512_mask_loadu_ps(_mm512_set1_ps(kMasked), in, s + j);
    const __mmask16 live = _mm512_cmp_ps_mask(x, half, _CMP_GT_OQ);
    const __m512 p = _mm512_maskz_mov_ps(live, exp16(_mm512_sub_ps(x, vmx)));
    _mm512_mask_storeu_ps(s + j, in, p);
    vsum = _mm512_add_ps(vsum, p);
  }
  sum = _mm512_reduce_add_ps(vsum);
#elif defined(RPA_AVX2)
  const __m256 vmx = _mm256_set1_ps(mx), half = _mm256_set1_ps(0.5f * kMasked), masked = _mm256_set1_ps(kMasked);
  __m256 vsum = _mm256_setzero_ps();
  // As the AVX-512 loop: the tail is a masked vector, so where the segment ends changes nothing.
  for (; j < n; j += 8) {
    const __m256i in = lanes8(n - j);
    const __m256 x = _mm256_blendv_ps(masked, _mm256_maskload_ps(s + j, in), _mm256_castsi256_ps(in));
    const __m256 live = _mm256_cmp_ps(x, half, _CMP_GT_OQ);
    const __m256 p = _mm256_and_ps(live, exp8(_mm256_sub_ps(x, vmx)));
    _mm256_maskstore_ps(s + j, in, p);
    vsum = _mm256_add_ps(vsum, p);
  }
  const __m128 h4 = _mm_add_ps(_mm256_castps256_ps128(vsum), _mm256_extractf128_ps(vsum, 1));
  const __m128 h2 = _mm_add_ps(h4, _mm_movehl_ps(h4, h4));
  sum = _mm_cvtss_f32(_mm_add_ss(h2, _mm_shuffle_ps(h2, h2, 1)));
#endif
  for (; j < n; ++j) {
    s[j] = s[j] > 0.5f * kMasked ? std::exp(s[j] - mx) : 0.0f;
    sum += s[j];
  }
  *l = std::fma(*l, alpha, sum);  // as softmax_update16 does
  *m = mx;
  return alpha;
}

#if defined(__AVX512F__)
// softmax_update for `count` <= 16 score rows (rows Sp floats apart) over a segment of n <= 16
// keys, all rows at once: the row maxima and sums come from one 16 x 16 reduction each
// instead of a serial scalar max and a horizontal sum per row. Same arithmetic per row as
// softmax_update (the max is exact in any order; the sum runs in _mm512_reduce_add_ps's tree;
// alpha is the same std::exp), so results do not depend on which path or rows ran.
//
// With `vs` (quantized V: per KV head the segment's V scales [Hkv][Sp]), the weights stored
// are also multiplied by their key's scale, as the caller would do after softmax_update; the
// sums are of the unscaled weights. Row i of the call is row r0 + i of the block (head
// ((r0 + i) % Hq) / G).
inline void softmax_update16(float* s, int64_t Sp, int64_t count, int64_t n, float* m, float* l, float* alpha,
                             const float* vs, int64_t r0, int64_t Hq, int64_t G) {
  const __mmask16 in = lane_range(0, n - 1), rows = lane_range(0, count - 1);
  const __m512 masked = _mm512_set1_ps(kMasked), half = _mm512_set1_ps(0.5f * kMasked);
  __m512 x[16];
  for (int64_t i = 0; i < 16; ++i) x[i] = i < count ? _mm512_mask_loadu_ps(masked, in, s + i * Sp) : masked;
  const __m512 m_old = _mm512_mask_loadu_ps(masked, rows, m);
  const __m512 mx = _mm512_max_ps(m_old, reduce_max_16x16(x));
  alignas(64) float mxs[16], diff[16];
  _mm512_store_ps(mxs, mx);
  _mm512_store_ps(diff, _mm512_sub_ps(m_old, mx));
  for (int64_t i = 0; i < 16; ++i) {
    if (i >= count) {
      x[i] = _mm512_setzero_ps();
      continue;
    }
    alpha[i] = std::exp(diff[i]);
    const __mmask16 live = _mm512_cmp_ps_mask(x[i], half, _CMP_GT_OQ);
    x[i] = _mm512_maskz_mov_ps(live, exp16(_mm512_sub_ps(x[i], _mm512_set1_ps(mxs[i]))));
    const __m512 stored = vs == nullptr ? x[i] : _mm512_mul_ps(x[i], _mm512_loadu_ps(vs + (((r0 + i) % Hq) / G) * Sp));
    _mm512_mask_storeu_ps(s + i * Sp, in, stored);
  }
  const __m512 a = _mm512_mask_loadu_ps(_mm512_set1_ps(1.0f), rows, alpha);
  _mm512_mask_storeu_ps(l, rows, _mm512_fmadd_ps(_mm512_mask_loadu_ps(_mm512_setzero_ps(), rows, l), a,
                                                  reduce_add_16x16(x)));
  _mm512_mask_storeu_ps(m, rows, mx);
}
#endif

struct Problem {
  int64_t num_tokens, num_q_heads, head_dim, num_pages, page_size, num_kv_heads, max_pages;
  float sm_scale;
  int64_t sliding_window;  // 0: none
  int64_t attention_chunk;  // 0: none; else a position sees only keys of its own chunk
  float soft_cap;          // 0: none
  const float* sinks;      // [Hq] learned logits that join every row's softmax denominator; nullptr: none
  const int32_t* kv_lens;
  const int32_t* tables;
  const int32_t* cu_q_lens;
  const int32_t* attend_until;  // [T]: a token's last key is max(p, this) (clipped to kv_len - 1)
  std::vector<int64_t> item_seq, item_first, item_count;  // one entry per work item
};

struct Scratch {  // per thread, reused across calls
  std::vector<float> q, acc, scores, m, l, vs;  // vs: a page segment's V scales [Hkv, Sp]
  std::vector<float> kf;  // a page segment's keys widened to f32 [n, Hkv, D]
};

#if defined(__AVX512F__)
// The scores of one page segment (n keys from `kb`, cache slots of Hkv * D; `sk`: their K
// scales [n, Hkv] when quantized) for the block's nb tokens, into w.scores (row r of token i
// at [(i * Hq + r) * Sp + j]): 16 keys at a time per query head, then the keys a token
// cannot see set to kMasked. The same arithmetic per score as `dots` + the scale, so
// results do not depend on the block or the key grouping.
template <typename KV>
void segment_scores(const Problem& p, Scratch& w, const KV* kb, const float* sk, int64_t n, int64_t start,
                    int64_t nb, const int64_t* pos, const int64_t* lo) {
  constexpr bool kQuant = Quant<KV>::value;
  const int64_t D = p.head_dim, Hq = p.num_q_heads, Hkv = p.num_kv_heads, G = Hq / Hkv;
  const int64_t Dp = round_up(D, kLanes), Sp = round_up(p.page_size, kLanes), slot = Hkv * D;
  const float* kf;
  if constexpr (std::is_same_v<KV, float>) {
    kf = kb;
  } else {  // widened once per segment, not once per token and head
    w.kf.resize(n * slot);
    for (int64_t x = 0; x < n * slot; x += 16) _mm512_storeu_ps(w.kf.data() + x, load16(kb + x));
    kf = w.kf.data();
  }
  alignas(64) float f[16], tmp[16];
  const __m512 masked = _mm512_set1_ps(kMasked);
  // A score row's 16 lanes from its raw dots: the K scale, the soft cap, the mask.
  auto finish = [&](int64_t r, int64_t j0, __mmask16 valid, __mmask16 live, __m512 v) {
    if constexpr (kQuant) v = _mm512_mul_ps(v, _mm512_load_ps(f));
    if (p.soft_cap > 0.0f) {
      _mm512_store_ps(tmp, v);
      for (int64_t j = 0; j < 16; ++j) tmp[j] = p.soft_cap * std::tanh(tmp[j] / p.soft_cap);
      v = _mm512_load_ps(tmp);
    }
    _mm512_mask_storeu_ps(w.scores.data() + r * Sp + j0, valid, _mm512_mask_blend_ps(live, masked, v));
  };
  for (int64_t j0 = 0; j0 < n; j0 += 16) {
    const int64_t jn = std::min<int64_t>(16, n - j0);
    const __mmask16 valid = lane_range(0, jn - 1);
    __mmask16 live[kQueryBlock];
    for (int64_t i = 0; i < nb; ++i) live[i] = valid & lane_range(lo[i] - start - j0, pos[i] - start - j0);
    for (int64_t h = 0; h < Hkv; ++h) {
      if constexpr (kQuant) {
        for (int64_t j = 0; j < 16; ++j) f[j] = sk[(j0 + (j < jn ? j : jn - 1)) * Hkv + h] * decode_factor<KV>();
      }
      const float* kh = kf + j0 * slot + h * D;
      for (int64_t i = 0; i < nb; ++i)
        for (int64_t g = 0; g < G; ++g) {
          const int64_t r = i * Hq + h * G + g;
          if (!live[i]) _mm512_mask_storeu_ps(w.scores.data() + r * Sp + j0, valid, masked);
          else finish(r, j0, valid, live[i], scores16(w.q.data() + r * Dp, kh, slot, jn, D));
        }
    }
  }
}
#endif

#if defined(RPA_AVX2)
// segment_scores in 8-key groups (D % 8 == 0): the same arithmetic per score in any block.
template <typename KV>
void segment_scores_avx2(const Problem& p, Scratch& w, const KV* kb, const float* sk, int64_t n, int64_t start,
                         int64_t nb, const int64_t* pos, const int64_t* lo) {
  constexpr bool kQuant = Quant<KV>::value;
  const int64_t D = p.head_dim, Hq = p.num_q_heads, Hkv = p.num_kv_heads, G = Hq / Hkv;
  const int64_t Dp = round_up(D, kLanes), Sp = round_up(p.page_size, kLanes), slot = Hkv * D;
  const float* kf;
  if constexpr (std::is_same_v<KV, float>) {
    kf = kb;
  } else {  // widened once per segment, not once per token and head
    w.kf.resize(n * slot);
    for (int64_t x = 0; x < n * slot; x += 8) _mm256_storeu_ps(w.kf.data() + x, load8(kb + x));
    kf = w.kf.data();
  }
  alignas(32) float f[8], tmp[8];
  const __m256 masked = _mm256_set1_ps(kMasked);
  const __m256i idx = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  for (int64_t j0 = 0; j0 < n; j0 += 8) {
    const int64_t jn = std::min<int64_t>(8, n - j0);
    const __m256i valid = lanes8(jn);
    __m256 live[kQueryBlock];  // key start + j0 + lane in [lo[i], pos[i]]
    bool any[kQueryBlock];
    for (int64_t i = 0; i < nb; ++i) {
      const __m256i key = _mm256_add_epi32(idx, _mm256_set1_epi32(static_cast<int32_t>(start + j0)));
      const __m256i in = _mm256_andnot_si256(
          _mm256_or_si256(_mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int32_t>(lo[i])), key),
                          _mm256_cmpgt_epi32(key, _mm256_set1_epi32(static_cast<int32_t>(pos[i])))),
          valid);
      live[i] = _mm256_castsi256_ps(in);
      any[i] = !_mm256_testz_si256(in, in);
    }
    for (int64_t h = 0; h < Hkv; ++h) {
      if constexpr (kQuant) {
        for (int64_t j = 0; j < 8; ++j) f[j] = sk[(j0 + (j < jn ? j : jn - 1)) * Hkv + h] * decode_factor<KV>();
      }
      const float* kh = kf + j0 * slot + h * D;
      for (int64_t i = 0; i < nb; ++i)
        for (int64_t g = 0; g < G; ++g) {
          const int64_t r = i * Hq + h * G + g;
          float* dst = w.scores.data() + r * Sp + j0;
          if (!any[i]) {
            _mm256_maskstore_ps(dst, valid, masked);
            continue;
          }
          __m256 v = scores8(w.q.data() + r * Dp, kh, slot, jn, D);
          if constexpr (kQuant) v = _mm256_mul_ps(v, _mm256_load_ps(f));
          if (p.soft_cap > 0.0f) {
            _mm256_store_ps(tmp, v);
            for (int64_t j = 0; j < 8; ++j) tmp[j] = p.soft_cap * std::tanh(tmp[j] / p.soft_cap);
            v = _mm256_load_ps(tmp);
          }
          _mm256_maskstore_ps(dst, valid, _mm256_blendv_ps(masked, v, live[i]));
        }
    }
  }
}
#endif

#if defined(__AVX512F__) || defined(RPA_AVX2)
// The rows of pv_rows_avx512 / pv_rows_avx2 (this build's width).
template <int NG, typename KV>
inline void pv_rows(float* acc, int64_t stride, const float* w, int64_t w_stride, const int64_t* r, const KV* v,
                    int64_t v_stride, int64_t n, int64_t D) {
#if defined(__AVX512F__)
  pv_rows_avx512<NG>(acc, stride, w, w_stride, r, v, v_stride, n, D);
#else
  pv_rows_avx2<NG>(acc, stride, w, w_stride, r, v, v_stride, n, D);
#endif
}
#endif

#if defined(__AVX512F__) || defined(RPA_AVX2)
// P.V of one page segment (n values from `vb`) for the block's nb tokens: per KV head its
// rows (every token and query head of the group) 8 at a time, in this build's vector width. Same per-row arithmetic as `pv`.
template <typename KV>
void segment_pv(Scratch& w, const KV* vb, int64_t n, int64_t nb, int64_t Hq, int64_t Hkv, int64_t D, int64_t Dp,
                int64_t Sp) {
  const int64_t G = Hq / Hkv, slot = Hkv * D;
  int64_t r[kQueryBlock * 256];
  for (int64_t h = 0; h < Hkv; ++h) {
    int64_t count = 0;
    for (int64_t i = 0; i < nb; ++i)
      for (int64_t g = 0; g < G; ++g) r[count++] = i * Hq + h * G + g;
    float* acc = w.acc.data();
    const float* sc = w.scores.data();
    const KV* v = vb + h * D;
    int64_t c = 0;
    for (; c + 8 <= count; c += 8) pv_rows<8>(acc, Dp, sc, Sp, r + c, v, slot, n, D);
    switch (count - c) {
      case 7: pv_rows<7>(acc, Dp, sc, Sp, r + c, v, slot, n, D); break;
      case 6: pv_rows<6>(acc, Dp, sc, Sp, r + c, v, slot, n, D); break;
      case 5: pv_rows<5>(acc, Dp, sc, Sp, r + c, v, slot, n, D); break;
      case 4: pv_rows<4>(acc, Dp, sc, Sp, r + c, v, slot, n, D); break;
      case 3: pv_rows<3>(acc, Dp, sc, Sp, r + c, v, slot, n, D); break;
      case 2: pv_rows<2>(acc, Dp, sc, Sp, r + c, v, slot, n, D); break;
      case 1: pv_rows<1>(acc, Dp, sc, Sp, r + c, v, slot, n, D); break;
      default: break;
    }
  }
}
#endif

// One cache line into L2 (prefetcht2 on x86). As inline asm: GCC 12 deleted the loops of
// `__builtin_prefetch(p, 0, 1)` / `_mm_prefetch` calls in `prefetch_page` (loops with no
// other effect), leaving no prefetch at all.
inline void prefetch_l2(const char* p) {
#if defined(__x86_64__)
  asm volatile("prefetcht2 %0" : : "m"(*p));
#else
  __builtin_prefetch(p, 0, 1);
#endif
}

// Asks for the K / V page holding key `at` (and its scales) into L2, if the sequence has
// it (at < key_hi). Into L2, not L1: prefetches into L1 take the few L1 miss buffers that
// the current page's loads need (the next page into L1 measured 1.24-1.41x slower on decode).
template <typename KV>
inline void prefetch_page(const Problem& p, const int32_t* table, int64_t at, int64_t key_hi, const KV* kp,
                          const KV* vp, const float* ksc, const float* vsc) {
  if (at >= key_hi) return;
  const int64_t ps = p.page_size, slot = p.num_kv_heads * p.head_dim;
  const int64_t page = std::clamp<int64_t>(table[at / ps], 0, p.num_pages - 1), keys = std::min(ps, key_hi - at);
  const char* k = reinterpret_cast<const char*>(kp + page * ps * slot);
  const char* v = reinterpret_cast<const char*>(vp + page * ps * slot);
  const int64_t bytes = keys * slot * static_cast<int64_t>(sizeof(KV));
  for (int64_t b = 0; b < bytes; b += 64) {
    prefetch_l2(k + b);
    prefetch_l2(v + b);
  }
  if constexpr (Quant<KV>::value) {
    const char* ks = reinterpret_cast<const char*>(ksc + page * ps * p.num_kv_heads);
    const char* vs = reinterpret_cast<const char*>(vsc + page * ps * p.num_kv_heads);
    const int64_t sbytes = keys * p.num_kv_heads * static_cast<int64_t>(sizeof(float));
    for (int64_t b = 0; b < sbytes; b += 64) {
      prefetch_l2(ks + b);
      prefetch_l2(vs + b);
    }
  }
}

// The keys an item reads: from `first` (a page boundary) up to `hi` (exclusive); and each
// token's own bounds: its last key pos[i] (its position, or past it up to its attend_until,
// within kv_len) and the window's lowest key lo[i] (from its position).
struct ItemKeys {
  int64_t first = 0, hi = 0;
};
ItemKeys item_keys(const Problem& p, int64_t item, int64_t* pos, int64_t* lo) {
  const int64_t s = p.item_seq[item], t0 = p.item_first[item], nb = p.item_count[item], ps = p.page_size;
  const int64_t kv_len = std::min<int64_t>(std::max(p.kv_lens[s], 0), p.max_pages * ps);
  const int64_t q_len = p.cu_q_lens[s + 1] - p.cu_q_lens[s];
  int64_t key_lo = INT64_MAX, key_hi = 0;
  for (int64_t i = 0; i < nb; ++i) {
    pos[i] = p.kv_lens[s] - q_len + (t0 + i - p.cu_q_lens[s]);
    lo[i] = p.sliding_window > 0 ? std::max<int64_t>(0, pos[i] - p.sliding_window + 1) : 0;
    if (p.attention_chunk > 0) lo[i] = std::max(lo[i], pos[i] - pos[i] % p.attention_chunk);
    // From here pos[i] is only the last key the token sees (never lowered: <= p is causal).
    pos[i] = std::max<int64_t>(pos[i], std::min<int64_t>(p.attend_until[t0 + i], kv_len - 1));
    key_lo = std::min(key_lo, lo[i]);
    key_hi = std::max(key_hi, std::min(pos[i] + 1, kv_len));
  }
  return {key_lo - key_lo % ps, key_hi};
}

// ksc / vsc: the pages' scales [P, S, Hkv] for quantized KV, unused (null) otherwise.
// `next`: the item this thread takes after this one (-1: none); its first pages are asked
// for while this item's last ones are read, so that an item does not start on cold pages.
template <typename Q, typename KV>
void attend_item(const Problem& p, const Q* q, const KV* kp, const KV* vp, const float* ksc, const float* vsc, Q* out,
                 int64_t item, int64_t next) {
  constexpr bool kQuant = Quant<KV>::value;
  constexpr float kFactor = decode_factor<KV>();
  const int64_t D = p.head_dim, Hq = p.num_q_heads, Hkv = p.num_kv_heads, G = Hq / Hkv;
  const int64_t ps = p.page_size, Dp = round_up(D, kLanes), Sp = round_up(ps, kLanes);
  const int64_t s = p.item_seq[item], t0 = p.item_first[item], nb = p.item_count[item];
  const int64_t rows = nb * Hq;

  thread_local Scratch w;
  w.q.assign(rows * Dp, 0.0f);
  w.acc.assign(rows * Dp, 0.0f);
  w.scores.assign(rows * Sp, 0.0f);
  w.m.assign(rows, kMasked);
  w.l.assign(rows, 0.0f);
  if constexpr (kQuant) w.vs.assign(Hkv * Sp, 0.0f);
  int64_t pos[kQueryBlock], lo[kQueryBlock], next_pos[kQueryBlock], next_lo[kQueryBlock];
  const ItemKeys keys = item_keys(p, item, pos, lo);
  const int64_t key_hi = keys.hi, last_page = (key_hi - 1) / ps * ps;
  // (A next block of the same sequence reads pages this one has just brought in.)
  const bool other = next >= 0 && p.item_seq[next] != s;
  const ItemKeys after = other ? item_keys(p, next, next_pos, next_lo) : ItemKeys{};
  const int32_t* next_table = other ? p.tables + p.item_seq[next] * p.max_pages : nullptr;
  for (int64_t i = 0; i < nb; ++i) {
    const Q* qt = q + (t0 + i) * Hq * D;
    for (int64_t r = 0; r < Hq; ++r)
      for (int64_t d = 0; d < D; ++d) w.q[(i * Hq + r) * Dp + d] = to_f32(qt[r * D + d]) * p.sm_scale;
  }
  const int32_t* table = p.tables + s * p.max_pages;
  const int64_t slot = Hkv * D;  // elements per cache slot
  // Segments start on page boundaries whatever the block's first visible key, so every token
  // meets the same segments (pages it cannot see leave its softmax state untouched).
  for (int64_t start = keys.first; start < key_hi;) {
    const int64_t off = start % ps, n = std::min(ps - off, key_hi - start);
    const int64_t page = std::clamp<int64_t>(table[start / ps], 0, p.num_pages - 1);
    const KV* kb = kp + (page * ps + off) * slot;
    const KV* vb = vp + (page * ps + off) * slot;
    // The pages ahead are random: ask for the next kPagesAhead while this one is used. Each
    // segment asks again for all of them (a repeat costs little when the lines are there;
    // measured faster than asking once for the page kPagesAhead on, most with f32 pages).
    for (int64_t ahead = 1; ahead <= kPagesAhead; ++ahead) {
      const int64_t at = start - off + ahead * ps;
      if (at <= last_page) prefetch_page(p, table, at, key_hi, kp, vp, ksc, vsc);
      else if (next_table != nullptr)  // the next item's pages, in its order
        prefetch_page(p, next_table, after.first + (at - last_page - ps), after.hi, kp, vp, ksc, vsc);
    }
#if defined(__AVX512F__)
    if (D % 16 == 0) {
      segment_scores<KV>(p, w, kb, ksc == nullptr ? nullptr : ksc + (page * ps + off) * Hkv, n, start, nb, pos, lo);
    } else
#elif defined(RPA_AVX2)
    if (D % 8 == 0) {
      segment_scores_avx2<KV>(p, w, kb, ksc == nullptr ? nullptr : ksc + (page * ps + off) * Hkv, n, start, nb, pos,
                              lo);
    } else
#endif
    for (int64_t j = 0; j < n; ++j) {
      const int64_t key = start + j;
      for (int64_t i = 0; i < nb; ++i) {
        float* sc = w.scores.data() + i * Hq * Sp + j;  // row r at sc[r * Sp]
        if (key > pos[i] || key < lo[i]) {
          for (int64_t r = 0; r < Hq; ++r) sc[r * Sp] = kMasked;
          continue;
        }
        float d[256];
        for (int64_t h = 0; h < Hkv; ++h) dots(w.q.data() + (i * Hq + h * G) * Dp, Dp, kb + j * slot + h * D, G, D, d + h * G);
        if constexpr (kQuant) {
          const float* sk = ksc + (page * ps + off + j) * Hkv;
          for (int64_t h = 0; h < Hkv; ++h) {
            const float f = sk[h] * kFactor;
            for (int64_t g = 0; g < G; ++g) d[h * G + g] *= f;
          }
        }
        for (int64_t r = 0; r < Hq; ++r)
          sc[r * Sp] = p.soft_cap > 0.0f ? p.soft_cap * std::tanh(d[r] / p.soft_cap) : d[r];
      }
    }
    if constexpr (kQuant) {  // the segment's V scales per KV head
      const float* sv = vsc + (page * ps + off) * Hkv;
      for (int64_t j = 0; j < n; ++j)
        for (int64_t h = 0; h < Hkv; ++h) w.vs[h * Sp + j] = sv[j * Hkv + h] * kFactor;
    }
    // Masked keys get weight 0, so the PV sum runs over all n keys. Quantized V: each weight
    // times its key's scale (the denominator l sums the unscaled weights).
#if defined(__AVX512F__)
    if (n <= 16) {
      for (int64_t r0 = 0; r0 < rows; r0 += 16) {
        const int64_t count = std::min<int64_t>(16, rows - r0);
        float alpha[16];
        softmax_update16(w.scores.data() + r0 * Sp, Sp, count, n, &w.m[r0], &w.l[r0], alpha,
                         kQuant ? w.vs.data() : nullptr, r0, Hq, G);
        for (int64_t r = r0; r < r0 + count; ++r)
          if (alpha[r - r0] != 1.0f) {  // Dp lanes: the padding past D is 0 and stays 0
            const __m512 a = _mm512_set1_ps(alpha[r - r0]);
            float* acc = w.acc.data() + r * Dp;
            for (int64_t d = 0; d < Dp; d += 16) _mm512_storeu_ps(acc + d, _mm512_mul_ps(_mm512_loadu_ps(acc + d), a));
          }
      }
    } else
#endif
    for (int64_t r = 0; r < rows; ++r) {
      float* row = w.scores.data() + r * Sp;
      const float alpha = softmax_update(row, n, &w.m[r], &w.l[r]);
      if (alpha != 1.0f)
        for (int64_t d = 0; d < D; ++d) w.acc[r * Dp + d] *= alpha;
      if constexpr (kQuant) {
        const float* f = w.vs.data() + ((r % Hq) / G) * Sp;
        for (int64_t j = 0; j < n; ++j) row[j] *= f[j];
      }
    }
#if defined(__AVX512F__)
    if (D % 16 == 0) segment_pv<KV>(w, vb, n, nb, Hq, Hkv, D, Dp, Sp);
    else
#elif defined(RPA_AVX2)
    if (D % 8 == 0) segment_pv<KV>(w, vb, n, nb, Hq, Hkv, D, Dp, Sp);
    else
#endif
    for (int64_t i = 0; i < nb; ++i)
      for (int64_t h = 0; h < Hkv; ++h) {
        const int64_t r = i * Hq + h * G;
        pv(w.acc.data() + r * Dp, Dp, w.scores.data() + r * Sp, Sp, vb + h * D, slot, n, G, D);
      }
    start += n;
  }
  for (int64_t i = 0; i < nb; ++i) {
    Q* o = out + (t0 + i) * Hq * D;
    for (int64_t r = 0; r < Hq; ++r) {
      float l = w.l[i * Hq + r], scale = 1.0f;
      if (p.sinks != nullptr && l > 0.0f) {  // the sink's weight joins the denominator only
        const float m = w.m[i * Hq + r], sink = p.sinks[r], top = std::max(m, sink);
        scale = std::exp(m - top);
        l = l * scale + std::exp(sink - top);
      }
      const float inv = l > 0.0f ? scale / l : 0.0f;
      for (int64_t d = 0; d < D; ++d) store(w.acc[(i * Hq + r) * Dp + d] * inv, o + r * D + d);
    }
  }
}

struct Progress {  // shared with pool tasks, which may start after the call returned
  std::atomic<int64_t> next{0};
  std::atomic<int64_t> done{0};
};

template <typename Q, typename KV>
void run(const Problem& p, const void* q, const void* kp, const void* vp, const float* ksc, const float* vsc, void* out,
         ffi::ThreadPool& pool) {
  const int64_t items = static_cast<int64_t>(p.item_seq.size());
  auto progress = std::make_shared<Progress>();
  // Pool tasks hold `progress` only; they touch the buffers just while holding an item, and
  // the call returns only when every item is done.
  auto work = [&p, q, kp, vp, ksc, vsc, out, items](Progress& pr) {
    // Each thread claims its next item before it runs the current one (to prefetch its pages).
    for (int64_t i = pr.next.fetch_add(1); i < items;) {
      const int64_t next = pr.next.fetch_add(1);
      attend_item<Q, KV>(p, static_cast<const Q*>(q), static_cast<const KV*>(kp), static_cast<const KV*>(vp), ksc, vsc,
                         static_cast<Q*>(out), i, next < items ? next : -1);
      pr.done.fetch_add(1);
      i = next;
    }
  };
  const int64_t helpers = std::min<int64_t>(pool.num_threads(), items - 1);
  for (int64_t i = 0; i < helpers; ++i) {
    pool.Schedule([progress, work]() { work(*progress); });
  }
  work(*progress);
  while (progress->done.load() < items) std::this_thread::yield();
}

template <typename Q>
void run_q(const Problem& p, ffi::DataType kt, const void* q, const void* kp, const void* vp, const float* ksc,
           const float* vsc, void* out, ffi::ThreadPool& pool) {
  switch (kt) {
    case ffi::F32: run<Q, float>(p, q, kp, vp, nullptr, nullptr, out, pool); break;
    case ffi::BF16: run<Q, uint16_t>(p, q, kp, vp, nullptr, nullptr, out, pool); break;
    case ffi::S8: run<Q, int8_t>(p, q, kp, vp, ksc, vsc, out, pool); break;
    case ffi::F8E4M3FN: run<Q, E4M3>(p, q, kp, vp, ksc, vsc, out, pool); break;
    case ffi::F8E5M2: run<Q, E5M2>(p, q, kp, vp, ksc, vsc, out, pool); break;
    default: break;
  }
}

inline bool quantized(ffi::DataType t) { return t == ffi::S8 || t == ffi::F8E4M3FN || t == ffi::F8E5M2; }

// k_scales / v_scales: null for float pages; [P, S, Hkv] f32 for quantized ones.
ffi::Error Attend(ffi::ThreadPool pool, ffi::AnyBuffer q, ffi::AnyBuffer k_pages, ffi::AnyBuffer v_pages,
                  const ffi::Buffer<ffi::F32>* k_scales, const ffi::Buffer<ffi::F32>* v_scales,
                  ffi::Buffer<ffi::S32> kv_lens, ffi::Buffer<ffi::S32> block_tables, ffi::Buffer<ffi::S32> cu_q_lens,
                  ffi::Buffer<ffi::S32> num_seqs, ffi::Buffer<ffi::S32> sliding_window,
                  ffi::Buffer<ffi::F32> sinks, ffi::Buffer<ffi::S32> attend_until, ffi::Result<ffi::AnyBuffer> out,
                  float sm_scale, float soft_cap, bool use_sinks) {
  const auto qd = q.dimensions(), kd = k_pages.dimensions();
  if (qd.size() != 3 || kd.size() != 4 || kd[3] != qd[2] || qd[1] % kd[2] != 0)
    return ffi::Error::InvalidArgument("expected q [T, Hq, D] and pages [P, S, Hkv, D] with Hq % Hkv == 0");
  if (qd[1] > 256) return ffi::Error::InvalidArgument("at most 256 query heads");
  if (sliding_window.element_count() != 1 && sliding_window.element_count() != 2)
    return ffi::Error::InvalidArgument("sliding_window must hold the window, and optionally the attention chunk");
  if (use_sinks && static_cast<int64_t>(sinks.element_count()) != qd[1])
    return ffi::Error::InvalidArgument("sinks must hold one f32 per query head");
  if (static_cast<int64_t>(attend_until.element_count()) != qd[0])
    return ffi::Error::InvalidArgument("attend_until must hold one int32 per query token");
  const auto qt = q.element_type(), kt = k_pages.element_type();
  if ((qt != ffi::F32 && qt != ffi::BF16) || v_pages.element_type() != kt)
    return ffi::Error::InvalidArgument("q must be float32 or bfloat16, K and V pages alike");
  if (k_scales == nullptr && kt != ffi::F32 && kt != ffi::BF16)
    return ffi::Error::InvalidArgument("pages must be float32 or bfloat16 (quantized ones take the scales target)");
  if (k_scales != nullptr) {
    if (!quantized(kt)) return ffi::Error::InvalidArgument("scales come with int8 / float8_e4m3fn / float8_e5m2 pages");
    const int64_t want = kd[0] * kd[1] * kd[2];
    const auto sd = k_scales->dimensions(), vd = v_scales->dimensions();
    if (sd.size() != 3 || vd.size() != 3 || k_scales->element_count() != want || v_scales->element_count() != want ||
        sd[0] != kd[0] || sd[1] != kd[1] || sd[2] != kd[2])
      return ffi::Error::InvalidArgument("scales must be f32 [P, S, Hkv] like the pages");
  }
  Problem p;
  p.num_tokens = qd[0];
  p.num_q_heads = qd[1];
  p.head_dim = qd[2];
  p.num_pages = kd[0];
  p.page_size = kd[1];
  p.num_kv_heads = kd[2];
  p.max_pages = block_tables.dimensions()[1];
  p.sm_scale = sm_scale;
  p.sliding_window = std::max<int64_t>(sliding_window.typed_data()[0], 0);
  p.attention_chunk = sliding_window.element_count() > 1 ? std::max<int64_t>(sliding_window.typed_data()[1], 0) : 0;
  p.soft_cap = soft_cap;
  p.sinks = use_sinks ? sinks.typed_data() : nullptr;
  p.kv_lens = kv_lens.typed_data();
  p.tables = block_tables.typed_data();
  p.cu_q_lens = cu_q_lens.typed_data();
  p.attend_until = attend_until.typed_data();
  const int64_t num_rows = kv_lens.dimensions()[0];
  const int64_t n = std::clamp<int64_t>(num_seqs.typed_data()[0], 0, num_rows);
  int64_t covered = 0;  // tokens before this are real: cu_q_lens is nondecreasing
  for (int64_t s = 0; s < n; ++s) {
    const int64_t a = std::clamp<int64_t>(p.cu_q_lens[s], covered, p.num_tokens);
    const int64_t b = std::clamp<int64_t>(p.cu_q_lens[s + 1], a, p.num_tokens);
    for (int64_t t = a; t < b; t += kQueryBlock) {
      p.item_seq.push_back(s);
      p.item_first.push_back(t);
      p.item_count.push_back(std::min(kQueryBlock, b - t));
    }
    covered = b;
  }
  // Rows past the real tokens are zero.
  const size_t elem = qt == ffi::F32 ? 4 : 2;
  std::memset(static_cast<char*>(out->untyped_data()) + covered * p.num_q_heads * p.head_dim * elem, 0,
              (p.num_tokens - covered) * p.num_q_heads * p.head_dim * elem);
  if (p.item_seq.empty()) return ffi::Error::Success();
  const void *qp = q.untyped_data(), *kp = k_pages.untyped_data(), *vp = v_pages.untyped_data();
  const float* ksc = k_scales ? k_scales->typed_data() : nullptr;
  const float* vsc = v_scales ? v_scales->typed_data() : nullptr;
  void* op = out->untyped_data();
  if (qt == ffi::F32) run_q<float>(p, kt, qp, kp, vp, ksc, vsc, op, pool);
  else run_q<uint16_t>(p, kt, qp, kp, vp, ksc, vsc, op, pool);
  return ffi::Error::Success();
}

ffi::Error Impl(ffi::ThreadPool pool, ffi::AnyBuffer q, ffi::AnyBuffer k_pages, ffi::AnyBuffer v_pages,
                ffi::Buffer<ffi::S32> kv_lens, ffi::Buffer<ffi::S32> block_tables, ffi::Buffer<ffi::S32> cu_q_lens,
                ffi::Buffer<ffi::S32> num_seqs, ffi::Buffer<ffi::S32> sliding_window, ffi::Buffer<ffi::F32> sinks,
                ffi::Buffer<ffi::S32> attend_until, ffi::Result<ffi::AnyBuffer> out, float sm_scale, float soft_cap,
                bool use_sinks) {
  return Attend(pool, q, k_pages, v_pages, nullptr, nullptr, kv_lens, block_tables, cu_q_lens, num_seqs,
                sliding_window, sinks, attend_until, out, sm_scale, soft_cap, use_sinks);
}

ffi::Error ImplQuantized(ffi::ThreadPool pool, ffi::AnyBuffer q, ffi::AnyBuffer k_pages, ffi::AnyBuffer v_pages,
                         ffi::Buffer<ffi::F32> k_scales, ffi::Buffer<ffi::F32> v_scales, ffi::Buffer<ffi::S32> kv_lens,
                         ffi::Buffer<ffi::S32> block_tables, ffi::Buffer<ffi::S32> cu_q_lens,
                         ffi::Buffer<ffi::S32> num_seqs, ffi::Buffer<ffi::S32> sliding_window,
                         ffi::Buffer<ffi::F32> sinks, ffi::Buffer<ffi::S32> attend_until,
                         ffi::Result<ffi::AnyBuffer> out, float sm_scale, float soft_cap, bool use_sinks) {
  return Attend(pool, q, k_pages, v_pages, &k_scales, &v_scales, kv_lens, block_tables, cu_q_lens, num_seqs,
                sliding_window, sinks, attend_until, out, sm_scale, soft_cap, use_sinks);
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxserveRaggedPagedAttentionCpu, Impl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()          // q
                                  .Arg<ffi::AnyBuffer>()          // k_pages
                                  .Arg<ffi::AnyBuffer>()          // v_pages
                                  .Arg<ffi::Buffer<ffi::S32>>()   // kv_lens
                                  .Arg<ffi::Buffer<ffi::S32>>()   // block_tables
                                  .Arg<ffi::Buffer<ffi::S32>>()   // cu_q_lens
                                  .Arg<ffi::Buffer<ffi::S32>>()   // num_seqs
                                  .Arg<ffi::Buffer<ffi::S32>>()   // [window, attention chunk], <= 0: none
                                  .Arg<ffi::Buffer<ffi::F32>>()   // sinks [Hq] (read with use_sinks)
                                  .Arg<ffi::Buffer<ffi::S32>>()   // attend_until [T] (<= p: causal)
                                  .Ret<ffi::AnyBuffer>()          // out
                                  .Attr<float>("sm_scale")
                                  .Attr<float>("soft_cap")
                                  .Attr<bool>("use_sinks"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxserveRaggedPagedAttentionCpuQuantized, ImplQuantized,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()          // q
                                  .Arg<ffi::AnyBuffer>()          // k_pages (int8 / f8e4m3fn / f8e5m2)
                                  .Arg<ffi::AnyBuffer>()          // v_pages
                                  .Arg<ffi::Buffer<ffi::F32>>()   // k_scales [P, S, Hkv]
                                  .Arg<ffi::Buffer<ffi::F32>>()   // v_scales [P, S, Hkv]
                                  .Arg<ffi::Buffer<ffi::S32>>()   // kv_lens
                                  .Arg<ffi::Buffer<ffi::S32>>()   // block_tables
                                  .Arg<ffi::Buffer<ffi::S32>>()   // cu_q_lens
                                  .Arg<ffi::Buffer<ffi::S32>>()   // num_seqs
                                  .Arg<ffi::Buffer<ffi::S32>>()   // [window, attention chunk], <= 0: none
                                  .Arg<ffi::Buffer<ffi::F32>>()   // sinks [Hq] (read with use_sinks)
                                  .Arg<ffi::Buffer<ffi::S32>>()   // attend_until [T] (<= p: causal)
                                  .Ret<ffi::AnyBuffer>()          // out
                                  .Attr<float>("sm_scale")
                                  .Attr<float>("soft_cap")
                                  .Attr<bool>("use_sinks"));

// The instruction set this build's inner loops were compiled for (the test log and `jaxserve
// info` name it, so a result says which path produced it).
extern "C" const char* JaxserveRaggedPagedAttentionCpuIsa() {
#if defined(__AVX512F__)
  return "avx512";
#elif defined(RPA_AVX2)
  return "avx2";
#else
  return "generic (compiler-vectorised)";
#endif
}
