// Weight-only int8 matmul for XLA:CPU, as an XLA FFI custom call; also the bf16-weight
// matmul of the CPU's bf16 serving path (`dense.py`).
//
//   out[m, n] = (sum_k x[m, k] * w[k, n]) * scale[n]      (f32 accumulation)
//
// w is int8, or bf16 with or without a scale (a 0-element scale: none). The paths below are
// templates over the weight type: a bf16 weight is widened with a shift where an int8 one
// is converted, and both are packed into the same bf16-pair panels. out is x's dtype, or f32
// from bf16 x (the head's logits, kept as the f32 sums).
//
// With a `residual` operand ([M, N], x's dtype; the ...Residual target) the result is
// residual + that, as the separate add would give it (the product rounded to out's dtype,
// then the sum rounded), without writing the product and reading it back.
//
// With `glu` (the ...Glu target; 1: SiLU) the result is a gated MLP's activation instead:
// out [M, N / 2] = act(g) * u, g and u the product's columns j and N / 2 + j as the plain
// call would write them (rounded to out's dtype first), act and the product in f32, rounded
// once. The matmul's sums go to an f32 scratch (row chunks of kGluRows) and one pass over it
// writes out: the gate/up product is never written in out's dtype and read back by a separate
// elementwise program.
//
// `rows` (int32 []): the live rows. Only rows [0, rows) are computed, the rest of out is
// written 0: a padded batch pays for its real tokens only. Which path runs still follows M
// (the padded shape), so a live row's bits do not depend on how many rows are live.
//
// x [M, K] f32 or bf16, w [K, N] int8 or stacked [L, K, N] with an int32 `layer` operand
// (read in place: no slice is copied), or with `w_transposed` w [N, K] (a tied embedding
// read as the LM head, without a transposed copy), scale [N] or [L, N] f32, out [M, N] in
// x's dtype.
// XLA:CPU converts the whole int8 weight into an f32 temporary on every call and then runs
// an f32 GEMM, so int8 is slower than f32 there; this kernel reads the int8 weight and widens
// it in registers or in a cache-resident panel.
//
// `bf16_products`: x is rounded to bf16 before the products (exact when x is bf16 already).
// Without it (f32 x) every product is f32 x f32 and the result is the reference's up to
// summation order.
//
// - Direct path (M <= 4, decode; every M without AVX2): bound by memory bandwidth on the
//   weight. An item is a block of weight rows by up to 4096 columns (one contiguous block
//   when N fits); it streams 8 rows side by side, widens each 16-column slice int8 -> int32
//   -> f32 once and multiplies it into every row's partial sums (L1-resident), while the
//   next 8 rows are prefetched into L2 (small matrices are otherwise bound by DRAM latency:
//   2-3x slower measured). Splitting K gives every thread contiguous memory; each k-part
//   writes partial sums and the last one of a column range to finish adds them up. Reading
//   down a column tile instead (accumulators in registers, rows N bytes apart) measured at
//   half the bandwidth.
// - Packed path (M > 4, compute-bound): a block of up to kPanelK weight rows by up to 4
//   64-column panels is widened once into cache-resident panels (row by row: contiguous
//   reads), then a 6 x 64 register-blocked micro kernel runs over every 6-row tile of an
//   m-block (the conversion is paid once per m-block, not per row tile); partial sums live
//   in a per-item scratch. f32 products: f32 panels and FMAs. bf16 products (with
//   AVX512-BF16): bf16 panels with pairs of k rows interleaved and VDPBF16PS, twice the f32
//   FMA rate. On AVX2 + FMA (no AVX-512) the same panels feed a 6 x 16 ymm tile walked over
//   each panel in 16-column strips (f32 products only: bf16 x is widened). Before it, AVX2
//   ran every M on the direct path's portable loop, at a quarter of XLA's f32 dot from
//   64 rows on. While a block's tiles run, the item's next block is prefetched into L2. From
//   5 rows on this beats the direct path (which makes a second pass over L2 for rows 5-8):
//   8 rows 1.04-1.63x per SmolLM2 projection; at 4 rows the direct path wins.
//
// Work items (direct: weight-row block x column range; packed: m-block x panels) are
// taken from a shared atomic counter by the calling thread and XLA's intra-op pool
// (ffi::ThreadPool), as in the attention kernel: pool tasks hold only the counter, and the
// call returns when every item is done.

#include <algorithm>
#include <cmath>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <memory>
#include <thread>
#include <type_traits>
#include <vector>

#include "vec_math.h"
#include "xla/ffi/api/ffi.h"

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define QMM_AVX512 1
#include <immintrin.h>
#if defined(__AVX512BF16__)
#define QMM_AVX512_BF16 1
#endif
#elif defined(__AVX2__) && defined(__FMA__)
#define QMM_AVX2 1
#include <immintrin.h>
#endif
#if defined(QMM_AVX512) || defined(QMM_AVX2)
#define QMM_PACKED 1  // the packed path (M > kDirectMaxRows) exists in this build
#endif

namespace ffi = xla::ffi;

namespace {

constexpr int64_t kDirectMaxRows = 4;    // M at or below this: the direct path (one pass of 4 rows)
constexpr int64_t kDirectGroup = 4;      // rows of x per pass over a direct item's weights
constexpr int64_t kDirectCols = 4096;    // columns of a direct item at most
constexpr int64_t kDirectMinRows = 64;   // weight rows of a direct item at least
constexpr int64_t kPackedRows = 6;      // rows of the packed micro kernel's register tile
constexpr int64_t kPanel = 64;          // columns of a packed panel
constexpr int64_t kPanelK = 384;        // k rows of one packed panel (even: bf16 pairs)
constexpr int64_t kMBlock = 128;        // target rows of one packed m-block (48 measured 5-9% slower)
constexpr int64_t kMaxSpan = 4;         // 64-column panels packed together at most
constexpr int64_t kPackAhead = 8;       // weight rows prefetched ahead while packing
constexpr int64_t kGluRows = 256;       // rows of a gated call's chunk (its f32 scratch: kGluRows x N)
// Columns of the f32 micro kernel's strip of a panel: AVX-512's 6 x 64 tile takes the whole
// panel; AVX2's 6 x 16 ymm tile a quarter, each strip run over every row tile of the m-block
// while it sits in L1 (a whole f32 panel is 96 KB: walking it per tile ran from L2).
#if defined(QMM_AVX512)
constexpr int64_t kStrip = kPanel;
#else
constexpr int64_t kStrip = 16;
#endif

// Where column c (0 <= c < np * 64) of packed f32 row k goes: panel c / 64, strip (c % 64) /
// kStrip, row k of that strip ([kc][64] per panel on AVX-512, [4][kc][16] on AVX2).
inline int64_t strip_at(int64_t k, int64_t c) {
  return (c / kPanel) * kPanelK * kPanel + ((c % kPanel) / kStrip) * kPanelK * kStrip + k * kStrip + c % kStrip;
}

inline float bf16_to_f32(uint16_t x) {
  const uint32_t b = static_cast<uint32_t>(x) << 16;
  float f;
  std::memcpy(&f, &b, 4);
  return f;
}
inline uint16_t f32_to_bf16(float x) {  // round to nearest even; NaN stays NaN
  uint32_t b;
  std::memcpy(&b, &x, 4);
  if ((b & 0x7fffffffu) > 0x7f800000u) return 0x7fc0;
  b += 0x7fffu + ((b >> 16) & 1u);
  return static_cast<uint16_t>(b >> 16);
}

// A weight element's value: int8, or bf16 held as its 16 bits.
inline float wval(int8_t v) { return static_cast<float>(v); }
inline float wval(uint16_t v) { return bf16_to_f32(v); }

#if defined(QMM_AVX512)
inline __m512 bf16x16_to_f32(__m256i h) {  // 16 bf16 widened (exact)
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
#endif

// dst[i] = src[i] as f32, for n values (bf16 widened, or f32 rounded to bf16 and back).
void to_f32(const uint16_t* src, float* dst, int64_t n) {
  int64_t i = 0;
#if defined(QMM_AVX512)
  for (; i + 16 <= n; i += 16)
    _mm512_storeu_ps(dst + i, bf16x16_to_f32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + i))));
#endif
  for (; i < n; ++i) dst[i] = bf16_to_f32(src[i]);
}
void round_to_bf16(const float* src, uint16_t* dst, int64_t n) {
  int64_t i = 0;
#if defined(QMM_AVX512_BF16)
  for (; i + 16 <= n; i += 16)
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + i),
                        reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(_mm512_loadu_ps(src + i))));
#endif
  for (; i < n; ++i) dst[i] = f32_to_bf16(src[i]);
}

// A packed work item: rows [m0, m0 + rows) of x by the 64-column panels of span `span`.
struct PackedItem {
  int64_t m0, rows, span;
};

struct Problem {
  int64_t M, K, N;
  const float* x;      // [M, K] f32 (bf16 inputs widened; with bf16 products, rounded first)
  const uint16_t* xb;  // packed bf16 path: [M, Kp] bf16, K padded to even with 0; else null
  int64_t Kp;
  const void* w;        // [K, N] of the selected layer; [N, K] when wt: int8, or bf16 when w_bf16
  bool w_bf16;          // bf16 weights (int8 otherwise)
  int64_t wsize;        // bytes per weight element (1 or 2)
  bool wt;              // w_transposed: rows are output channels (a tied embedding as the LM head)
  const float* scale;   // [N], or null: no scale (bf16 weights)
  void* out;            // [M, N]
  const void* residual;  // [M, N] in out's dtype, added to the result; or null
  bool out_bf16;
  bool packed_path;  // the padded M > kDirectMaxRows: packed, however few rows are live
  // Direct path: items of krows weight rows by cw columns, kparts x nparts of them; with
  // several k-parts, their partial sums [kparts][M][N] and per column part a count of the
  // k-parts done. Packed path: rows per m-block, m-blocks.
  int64_t cw, nparts, krows, kparts;
  float* partial;
  std::atomic<int64_t>* parts_done;
  int64_t span_panels;
  const PackedItem* packed;  // the packed path's items
};

// The selected layer's weights as W (int8_t, or uint16_t for bf16).
template <typename W>
inline const W* weights(const Problem& p) {
  return static_cast<const W*>(p.w);
}

// Epilogue: rows [m0, m0 + rows), columns [n0, n0 + cols) of out = acc * scale (+ residual:
// the product rounded to out's dtype first, then the sum, as two separate ops would). The
// scalar loop (every column on a CPU without AVX-512) must not fuse the product and the sum
// into one FMA, which GCC does by default (-ffp-contract=fast) and which rounds once instead of
// twice: the residual's sum would then differ from the separate add in the last bit.
#if defined(__GNUC__) && !defined(__clang__)
__attribute__((optimize("fp-contract=off")))
#endif
void store_tile(const Problem& p, const float* acc, int64_t ld, int64_t m0, int64_t rows, int64_t n0,
                int64_t cols) {
  const float* res32 = p.out_bf16 ? nullptr : static_cast<const float*>(p.residual);
  const uint16_t* res16 = p.out_bf16 ? static_cast<const uint16_t*>(p.residual) : nullptr;
  for (int64_t i = 0; i < rows; ++i) {
    const float* a = acc + i * ld;
    const int64_t o = (m0 + i) * p.N + n0;
    int64_t j = 0;
#if defined(QMM_AVX512)
    for (; j < cols; j += 16) {
      const __mmask16 m = cols - j >= 16 ? 0xffff : static_cast<__mmask16>((1u << (cols - j)) - 1u);
      __m512 v = _mm512_maskz_loadu_ps(m, a + j);
      if (p.scale != nullptr) v = _mm512_mul_ps(v, _mm512_maskz_loadu_ps(m, p.scale + n0 + j));
      if (!p.out_bf16) {
        if (res32 != nullptr) v = _mm512_add_ps(_mm512_maskz_loadu_ps(m, res32 + o + j), v);
        _mm512_mask_storeu_ps(static_cast<float*>(p.out) + o + j, m, v);
      } else {
#if defined(QMM_AVX512_BF16)
        __m256i h = reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(v));
        if (res16 != nullptr) {
          const __m512 r = bf16x16_to_f32(_mm256_maskz_loadu_epi16(m, res16 + o + j));
          h = reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(_mm512_add_ps(r, bf16x16_to_f32(h))));
        }
        _mm256_mask_storeu_epi16(static_cast<uint16_t*>(p.out) + o + j, m, h);
#else
        alignas(64) float t[16];
        _mm512_store_ps(t, v);
        for (int64_t l = 0; l < std::min<int64_t>(16, cols - j); ++l) {
          uint16_t y = f32_to_bf16(t[l]);
          if (res16 != nullptr) y = f32_to_bf16(bf16_to_f32(res16[o + j + l]) + bf16_to_f32(y));
          static_cast<uint16_t*>(p.out)[o + j + l] = y;
        }
#endif
      }
    }
#endif
    for (; j < cols; ++j) {
      const float v = p.scale != nullptr ? a[j] * p.scale[n0 + j] : a[j];
      if (p.out_bf16) {
        uint16_t y = f32_to_bf16(v);
        if (res16 != nullptr) y = f32_to_bf16(bf16_to_f32(res16[o + j]) + bf16_to_f32(y));
        static_cast<uint16_t*>(p.out)[o + j] = y;
      } else {
        static_cast<float*>(p.out)[o + j] = res32 != nullptr ? res32[o + j] + v : v;
      }
    }
  }
}

#if defined(QMM_AVX512)

inline __mmask16 lane_mask(int64_t remaining) {
  return remaining >= 16 ? static_cast<__mmask16>(0xffff)
                         : static_cast<__mmask16>((1u << std::max<int64_t>(remaining, 0)) - 1u);
}

// 16 int8 weights at p widened to f32 (masked lanes read nothing and are 0).
template <bool kMasked>
inline __m512 load_w16(const int8_t* p, __mmask16 m) {
  __m128i b;
  if constexpr (kMasked) b = _mm_maskz_loadu_epi8(m, p);
  else b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(b));
}
// 16 bf16 weights at p widened to f32 (exact).
template <bool kMasked>
inline __m512 load_w16(const uint16_t* p, __mmask16 m) {
  __m256i h;
  if constexpr (kMasked) h = _mm256_maskz_loadu_epi16(m, p);
  else h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return bf16x16_to_f32(h);
}

// ---- Direct path ----

// acc[MR][0:cols] += x[0:MR, k:k + KU] @ w[k:k + KU, c0:c0 + cols] (acc rows ld floats
// apart): KU weight rows are streamed side by side, each 16-column slice widened once and
// multiplied into every row. With `prefetch` the next KU rows are requested into L2 as these
// are read, so a small matrix does not wait on DRAM latency row by row.
template <typename W, int MR, int KU>
inline void direct_rows(const Problem& p, int64_t k, int64_t c0, int64_t cols, float* acc, int64_t ld,
                        bool prefetch) {
  const int64_t N = p.N, K = p.K;
  constexpr int64_t kLine = 64 / sizeof(W);  // weights per cache line
  const W* w = weights<W>(p) + k * N + c0;
  __m512 xs[MR][KU];
#pragma GCC unroll 8
  for (int m = 0; m < MR; ++m)
#pragma GCC unroll 8
    for (int u = 0; u < KU; ++u) xs[m][u] = _mm512_set1_ps(p.x[m * K + k + u]);
  const int64_t full = cols & ~int64_t{15};
  for (int64_t j = 0; j < full; j += 16) {
    if (prefetch && (j & (kLine - 1)) == 0) {
#pragma GCC unroll 8
      for (int u = 0; u < KU; ++u) _mm_prefetch(reinterpret_cast<const char*>(w + (KU + u) * N + j), _MM_HINT_T1);
    }
    __m512 wv[KU];
#pragma GCC unroll 8
    for (int u = 0; u < KU; ++u) wv[u] = load_w16<false>(w + u * N + j, 0);
#pragma GCC unroll 8
    for (int m = 0; m < MR; ++m) {
      __m512 a = _mm512_loadu_ps(acc + m * ld + j);
#pragma GCC unroll 8
      for (int u = 0; u < KU; ++u) a = _mm512_fmadd_ps(xs[m][u], wv[u], a);
      _mm512_storeu_ps(acc + m * ld + j, a);
    }
  }
  if (full < cols) {
    const __mmask16 mask = lane_mask(cols - full);
    if (prefetch && (full & (kLine - 1)) == 0) {
#pragma GCC unroll 8
      for (int u = 0; u < KU; ++u) _mm_prefetch(reinterpret_cast<const char*>(w + (KU + u) * N + full), _MM_HINT_T1);
    }
    __m512 wv[KU];
#pragma GCC unroll 8
    for (int u = 0; u < KU; ++u) wv[u] = load_w16<true>(w + u * N + full, mask);
#pragma GCC unroll 8
    for (int m = 0; m < MR; ++m) {
      __m512 a = _mm512_maskz_loadu_ps(mask, acc + m * ld + full);
#pragma GCC unroll 8
      for (int u = 0; u < KU; ++u) a = _mm512_fmadd_ps(xs[m][u], wv[u], a);
      _mm512_mask_storeu_ps(acc + m * ld + full, mask, a);
    }
  }
}

template <typename W, int MR>
void direct_block(const Problem& p, int64_t k0, int64_t k1, int64_t c0, int64_t cols, float* acc, int64_t ld) {
  constexpr int KU = 8;  // weight rows per pass
  int64_t k = k0;
  for (; k + KU <= k1; k += KU) direct_rows<W, MR, KU>(p, k, c0, cols, acc, ld, k + 2 * KU <= k1);
  for (; k < k1; ++k) direct_rows<W, MR, 1>(p, k, c0, cols, acc, ld, false);
}

#endif  // QMM_AVX512

#if defined(QMM_AVX2)
// 8 weights at p widened to f32 (int8 converted, bf16 shifted).
inline __m256 load_w8(const int8_t* p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}
inline __m256 load_w8(const uint16_t* p) {
  const __m256i h = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(h, 16));
}

// direct_rows on AVX2: KU weight rows side by side, each 8-column slice widened once and
// multiplied into every row's partial sums, one FMA per k in k order (the portable loop's
// arithmetic and bits, at a third of its instructions: the sums are loaded and stored once
// per KU rows, not once per row). Columns past the last full slice take the scalar loop.
template <typename W, int MR, int KU>
inline void direct_rows_avx2(const Problem& p, int64_t k, int64_t c0, int64_t cols, float* acc, int64_t ld,
                             bool prefetch) {
  const int64_t N = p.N, K = p.K;
  constexpr int64_t kLine = 64 / sizeof(W);
  const W* w = weights<W>(p) + k * N + c0;
  __m256 xs[MR][KU];
#pragma GCC unroll 4
  for (int m = 0; m < MR; ++m)
#pragma GCC unroll 8
    for (int u = 0; u < KU; ++u) xs[m][u] = _mm256_broadcast_ss(p.x + m * K + k + u);
  const int64_t full = cols & ~int64_t{7};
  for (int64_t j = 0; j < full; j += 8) {
    if (prefetch && (j & (kLine - 1)) == 0) {
#pragma GCC unroll 8
      for (int u = 0; u < KU; ++u) _mm_prefetch(reinterpret_cast<const char*>(w + (KU + u) * N + j), _MM_HINT_T1);
    }
    __m256 wv[KU];
#pragma GCC unroll 8
    for (int u = 0; u < KU; ++u) wv[u] = load_w8(w + u * N + j);
#pragma GCC unroll 4
    for (int m = 0; m < MR; ++m) {
      __m256 a = _mm256_loadu_ps(acc + m * ld + j);
#pragma GCC unroll 8
      for (int u = 0; u < KU; ++u) a = _mm256_fmadd_ps(xs[m][u], wv[u], a);
      _mm256_storeu_ps(acc + m * ld + j, a);
    }
  }
  for (int64_t j = full; j < cols; ++j)
    for (int m = 0; m < MR; ++m) {
      float a = acc[m * ld + j];
      for (int u = 0; u < KU; ++u) a = std::fma(p.x[m * K + k + u], wval(w[u * N + j]), a);
      acc[m * ld + j] = a;
    }
}

template <typename W, int MR>
void direct_block_avx2(const Problem& p, int64_t k0, int64_t k1, int64_t c0, int64_t cols, float* acc, int64_t ld) {
  constexpr int KU = 4;  // weight rows per pass (4 widened slices + MR x 4 broadcasts in 16 ymm)
  int64_t k = k0;
  for (; k + KU <= k1; k += KU) direct_rows_avx2<W, MR, KU>(p, k, c0, cols, acc, ld, k + 2 * KU <= k1);
  for (; k < k1; ++k) direct_rows_avx2<W, MR, 1>(p, k, c0, cols, acc, ld, false);
}
#endif  // QMM_AVX2

// acc[0:rows][0:cols] += x[m0:m0 + rows, k0:k1] @ w[k0:k1, c0:c0 + cols] for the direct
// path (M <= 4; any rows on a host without AVX2, which runs every M this way; the loop below
// there, `direct_block` / `direct_block_avx2` with the same arithmetic elsewhere). One fused
// multiply-add per k, written out (not left to the compiler's contraction, which it applied
// here and not in `direct_t_item_any`'s loop): both layouts then round alike.
template <typename W>
void direct_rows_any(const Problem& p, int64_t m0, int64_t rows, int64_t k0, int64_t k1, int64_t c0, int64_t cols,
                     float* acc, int64_t ld) {
  const Problem q = [&] {
    Problem r = p;
    r.x = p.x + m0 * p.K;
    return r;
  }();
#if defined(QMM_AVX512)
  switch (rows) {
    case 1: return direct_block<W, 1>(q, k0, k1, c0, cols, acc, ld);
    case 2: return direct_block<W, 2>(q, k0, k1, c0, cols, acc, ld);
    case 3: return direct_block<W, 3>(q, k0, k1, c0, cols, acc, ld);
    default: return direct_block<W, 4>(q, k0, k1, c0, cols, acc, ld);
  }
#elif defined(QMM_AVX2)
  switch (rows) {
    case 1: return direct_block_avx2<W, 1>(q, k0, k1, c0, cols, acc, ld);
    case 2: return direct_block_avx2<W, 2>(q, k0, k1, c0, cols, acc, ld);
    case 3: return direct_block_avx2<W, 3>(q, k0, k1, c0, cols, acc, ld);
    default: return direct_block_avx2<W, 4>(q, k0, k1, c0, cols, acc, ld);
  }
#else
  for (int64_t k = k0; k < k1; ++k) {
    const W* row = weights<W>(q) + k * q.N + c0;
    for (int64_t m = 0; m < rows; ++m) {
      const float xv = q.x[m * q.K + k];
      float* a = acc + m * ld;
      for (int64_t j = 0; j < cols; ++j) a[j] = std::fma(xv, wval(row[j]), a[j]);
    }
  }
#endif
}

// One direct item: rows [k0, k1) of the weight by columns [c0, c0 + cw), every row of x. With
// one k-part the result goes to out; otherwise into this k-part's partial sums, and the last
// k-part of the column range to finish adds them up and writes out.
template <typename W>
void direct_item(const Problem& p, int64_t item) {
  const int64_t np = item % p.nparts, kp = item / p.nparts;
  const int64_t c0 = np * p.cw, cols = std::min(p.cw, p.N - c0);
  const int64_t k0 = kp * p.krows, k1 = std::min(p.K, k0 + p.krows);
  thread_local std::vector<float> own;
  float* acc;
  int64_t ld;
  if (p.kparts == 1) {
    ld = (cols + 15) / 16 * 16;
    own.resize(p.M * ld);
    acc = own.data();
  } else {
    ld = p.N;
    acc = p.partial + kp * p.M * p.N + c0;
  }
  for (int64_t m = 0; m < p.M; ++m) std::fill(acc + m * ld, acc + m * ld + cols, 0.0f);
  // Up to 4 rows per pass; a second pass re-reads the item's weight rows from L2.
  for (int64_t m0 = 0; m0 < p.M; m0 += kDirectGroup) {
    const int64_t rows = std::min(kDirectGroup, p.M - m0);
    direct_rows_any<W>(p, m0, rows, k0, k1, c0, cols, acc + m0 * ld, ld);
  }
  if (p.kparts == 1) return store_tile(p, acc, ld, 0, p.M, c0, cols);
  // Release this part's sums; the last part to arrive acquires all of them.
  if (p.parts_done[np].fetch_add(1, std::memory_order_acq_rel) + 1 < p.kparts) return;
  float* sum = p.partial + c0;  // k-part 0's rows receive the total
  for (int64_t m = 0; m < p.M; ++m) {
    float* dst = sum + m * p.N;
    for (int64_t q = 1; q < p.kparts; ++q) {
      const float* src = p.partial + q * p.M * p.N + m * p.N + c0;
      for (int64_t j = 0; j < cols; ++j) dst[j] += src[j];
    }
  }
  store_tile(p, sum, p.N, 0, p.M, c0, cols);
}

// The direct path for w [N, K] without AVX-512 (M <= 4 on AVX2, every M without it). Each
// channel sums its k-parts (`krows` rows each, as `direct_split` cuts them for w [K, N]) in
// order, then adds the parts up in order: the arithmetic of `direct_item`, so a tied head read
// as [N, K] gives the bits of the same head held as [K, N].
template <typename W>
void direct_t_item_any(const Problem& p, int64_t item) {
  const int64_t c0 = item * p.cw, cols = std::min(p.cw, p.N - c0);
  thread_local std::vector<float> own;
  own.resize(p.M * cols);
  for (int64_t m = 0; m < p.M; ++m)
    for (int64_t c = 0; c < cols; ++c) {
      const W* row = weights<W>(p) + (c0 + c) * p.K;
      float total = 0.0f;
      for (int64_t k0 = 0; k0 < p.K; k0 += p.krows) {
        float part = 0.0f;
        for (int64_t k = k0; k < std::min(p.K, k0 + p.krows); ++k)
          part = std::fma(p.x[m * p.K + k], wval(row[k]), part);  // as direct_rows_any
        total = k0 == 0 ? part : total + part;
      }
      own[m * cols + c] = total;
    }
  store_tile(p, own.data(), cols, 0, p.M, c0, cols);
}

#if defined(QMM_AVX512)

// ---- Packed path, f32 products ----

// The vector width of `store_widened` (pack_panels_f32).
constexpr int64_t kWidenLanes = 16;
// dst[0:16] = src[0:16] widened to f32, lanes at or past `remaining` 0 (read nothing).
template <typename W>
inline void store_widened(const W* src, int64_t remaining, float* dst) {
  _mm512_store_ps(dst, remaining >= 16 ? load_w16<false>(src, 0) : load_w16<true>(src, lane_mask(remaining)));
}

// c[MR][64] (+)= a[0:MR, 0:kc] @ panel[0:kc][64]; a rows lda floats apart, c rows ldc apart.
template <int MR>
void packed_tile_f32(const float* a, int64_t lda, const float* panel, int64_t kc, float* c, int64_t ldc,
                     bool accumulate) {
  __m512 acc[MR][4];
#pragma GCC unroll 8
  for (int m = 0; m < MR; ++m)
#pragma GCC unroll 4
    for (int v = 0; v < 4; ++v)
      acc[m][v] = accumulate ? _mm512_loadu_ps(c + m * ldc + 16 * v) : _mm512_setzero_ps();
  for (int64_t k = 0; k < kc; ++k) {
    const float* b = panel + k * kStrip;
    const __m512 b0 = _mm512_load_ps(b), b1 = _mm512_load_ps(b + 16);
    const __m512 b2 = _mm512_load_ps(b + 32), b3 = _mm512_load_ps(b + 48);
#pragma GCC unroll 8
    for (int m = 0; m < MR; ++m) {
      const __m512 x = _mm512_set1_ps(a[m * lda + k]);
      acc[m][0] = _mm512_fmadd_ps(x, b0, acc[m][0]);
      acc[m][1] = _mm512_fmadd_ps(x, b1, acc[m][1]);
      acc[m][2] = _mm512_fmadd_ps(x, b2, acc[m][2]);
      acc[m][3] = _mm512_fmadd_ps(x, b3, acc[m][3]);
    }
  }
#pragma GCC unroll 8
  for (int m = 0; m < MR; ++m)
#pragma GCC unroll 4
    for (int v = 0; v < 4; ++v) _mm512_storeu_ps(c + m * ldc + 16 * v, acc[m][v]);
}

// ---- Packed path, bf16 products ----
#if defined(QMM_AVX512_BF16)

// Two rows of f32 values exact in bf16 (widened int8) as the dwords VDPBF16PS reads:
// bf16(hi) << 16 | bf16(lo). The exact bf16 is the f32's upper half: a shift and a word
// blend instead of a rounding conversion (1.26x in a C test of the conversion alone; no
// change end to end, where packing waits on the weight's bytes).
inline __m512i bf16_pair(__m512 lo, __m512 hi) {
  return _mm512_mask_blend_epi16(0x55555555u, _mm512_castps_si512(hi), _mm512_srli_epi32(_mm512_castps_si512(lo), 16));
}

// w[k0:k0 + kc, n0:n0 + 64 * np] as bf16 (exact: |w| <= 128) into np panels
// [kc / 2][64][2], kPanelK * 64 apart: for each pair of k rows and each column the two weights
// side by side, as VDPBF16PS reads them. A row past K and columns past N are 0; kc is even.
template <typename W>
void pack_panels_bf16(const Problem& p, int64_t k0, int64_t kc, int64_t n0, int64_t np, uint16_t* panel) {
  const int64_t cols = std::min(np * kPanel, p.N - n0);
  for (int64_t j = 0; j < kc / 2; ++j) {
    const W* ra = weights<W>(p) + (k0 + 2 * j) * p.N + n0;
    const bool has_b = k0 + 2 * j + 1 < p.K;
    if (2 * j + kPackAhead + 1 < kc)
      for (int64_t c = 0; c < cols; c += 64 / sizeof(W)) {
        _mm_prefetch(reinterpret_cast<const char*>(ra + kPackAhead * p.N + c), _MM_HINT_T0);
        _mm_prefetch(reinterpret_cast<const char*>(ra + (kPackAhead + 1) * p.N + c), _MM_HINT_T0);
      }
    for (int64_t q = 0; q < np; ++q) {
      uint16_t* dst = panel + q * kPanelK * kPanel + j * kPanel * 2;
      if constexpr (std::is_same_v<W, uint16_t>) {
        // bf16 weights are interleaved as they are, one word permute per 16 columns (the
        // int8 route below, widening to f32 and taking the upper half back, is 3.5x the
        // instructions); the panels are the same bytes.
        const __m512i lo = _mm512_set_epi16(47, 15, 46, 14, 45, 13, 44, 12, 43, 11, 42, 10, 41, 9, 40, 8, 39, 7, 38, 6,
                                            37, 5, 36, 4, 35, 3, 34, 2, 33, 1, 32, 0);
        const __m512i hi = _mm512_add_epi16(lo, _mm512_set1_epi16(16));
        for (int v = 0; v < 4; v += 2) {
          const int64_t c = q * kPanel + 16 * v;
          const int64_t left = std::clamp<int64_t>(cols - c, 0, 32);
          const __mmask32 m = left == 32 ? ~0u : (1u << left) - 1u;
          const __m512i a = _mm512_maskz_loadu_epi16(m, ra + c);
          const __m512i b = has_b ? _mm512_maskz_loadu_epi16(m, ra + p.N + c) : _mm512_setzero_si512();
          _mm512_store_si512(dst + 32 * v, _mm512_permutex2var_epi16(a, lo, b));
          _mm512_store_si512(dst + 32 * v + 32, _mm512_permutex2var_epi16(a, hi, b));
        }
        continue;
      }
      for (int v = 0; v < 4; ++v) {
        const int64_t c = q * kPanel + 16 * v;
        const __mmask16 m = lane_mask(cols - c);
        const __m512 a = load_w16<true>(ra + c, m);
        const __m512 b = has_b ? load_w16<true>(ra + p.N + c, m) : _mm512_setzero_ps();
        _mm512_store_si512(dst + 32 * v, bf16_pair(a, b));
      }
    }
  }
}

// c[MR][64] (+)= a[0:MR, 0:2 * pairs] @ panel (bf16 pairs); a rows lda bf16 apart.
template <int MR>
void packed_tile_bf16(const uint16_t* a, int64_t lda, const uint16_t* panel, int64_t pairs, float* c,
                      bool accumulate) {
  __m512 acc[MR][4];
#pragma GCC unroll 8
  for (int m = 0; m < MR; ++m)
#pragma GCC unroll 4
    for (int v = 0; v < 4; ++v)
      acc[m][v] = accumulate ? _mm512_loadu_ps(c + m * kPanel + 16 * v) : _mm512_setzero_ps();
  for (int64_t j = 0; j < pairs; ++j) {
    const uint16_t* b = panel + j * kPanel * 2;
    const __m512bh b0 = reinterpret_cast<__m512bh>(_mm512_load_si512(b));
    const __m512bh b1 = reinterpret_cast<__m512bh>(_mm512_load_si512(b + 32));
    const __m512bh b2 = reinterpret_cast<__m512bh>(_mm512_load_si512(b + 64));
    const __m512bh b3 = reinterpret_cast<__m512bh>(_mm512_load_si512(b + 96));
#pragma GCC unroll 8
    for (int m = 0; m < MR; ++m) {
      int32_t pair;
      std::memcpy(&pair, a + m * lda + 2 * j, 4);
      const __m512bh x = reinterpret_cast<__m512bh>(_mm512_set1_epi32(pair));
      acc[m][0] = _mm512_dpbf16_ps(acc[m][0], x, b0);
      acc[m][1] = _mm512_dpbf16_ps(acc[m][1], x, b1);
      acc[m][2] = _mm512_dpbf16_ps(acc[m][2], x, b2);
      acc[m][3] = _mm512_dpbf16_ps(acc[m][3], x, b3);
    }
  }
#pragma GCC unroll 8
  for (int m = 0; m < MR; ++m)
#pragma GCC unroll 4
    for (int v = 0; v < 4; ++v) _mm512_storeu_ps(c + m * kPanel + 16 * v, acc[m][v]);
}

template <typename W>
struct PackedBf16 {
  using Panel = uint16_t;
  static constexpr bool kPairs = true;  // k rows go in pairs: a block's rows rounded up to even
  static constexpr int64_t kStrips = 1;
  static void pack(const Problem& p, int64_t k0, int64_t kc, int64_t n0, int64_t np, Panel* panel) {
    pack_panels_bf16<W>(p, k0, kc, n0, np, panel);
  }
  template <int MR>
  static void tile(const Problem& p, int64_t m, int64_t k0, int64_t kc, const Panel* panel, int64_t, float* c,
                   bool acc) {
    packed_tile_bf16<MR>(p.xb + m * p.Kp + k0, p.Kp, panel, kc / 2, c, acc);
  }
};
#endif

// ---- Transposed weights (w [N, K]: a tied embedding read as the LM head) ----
//
// Packing reads a dword (4 int8 or 2 bf16 k values) of 16 output channels at a time and
// spreads its elements over the panel rows, so the panels are the same as for [K, N] and the
// micro kernels are shared. Rows whose dword read would pass the end of a channel row take a
// scalar loop.

// Weight elements per dword.
template <typename W>
constexpr int64_t kPerDword = 4 / sizeof(W);

// The dword at w[n0 + lane][k] for the lanes of `m` (0 elsewhere).
template <typename W>
inline __m512i gather_t16(const Problem& p, int64_t n0, int64_t k, __mmask16 m) {
  const __m512i rows = _mm512_mullo_epi32(_mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0),
                                          _mm512_set1_epi32(static_cast<int32_t>(p.K * sizeof(W))));
  return _mm512_mask_i32gather_epi32(_mm512_setzero_si512(), m, rows, weights<W>(p) + n0 * p.K + k, 1);
}

// What gather_t16 gives for the 16 dwords of a 64-byte span (out[j] for k + j * kPerDword),
// from 16 contiguous 64-byte row reads and a 16 x 16 dword transpose in registers: a gather
// costs ~50 cycles here, the transpose 4 shuffles per row. Needs the span inside the rows;
// rows outside `m` read as 0.
template <typename W>
inline void dwords_t16x16(const Problem& p, int64_t n0, int64_t k, __mmask16 m, __m512i* out) {
  __m512i r[16], t[16];
  for (int l = 0; l < 16; ++l)
    r[l] = (m >> l) & 1 ? _mm512_loadu_si512(weights<W>(p) + (n0 + l) * p.K + k) : _mm512_setzero_si512();
  for (int i = 0; i < 8; ++i) {  // within 128-bit lanes: rows 2i, 2i+1 interleaved by dword
    t[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
  }
  for (int i = 0; i < 4; ++i) {  // lane L of r[4i + c]: rows 4i..4i+3 of column 4L + c
    r[4 * i + 0] = _mm512_unpacklo_epi64(t[4 * i], t[4 * i + 2]);
    r[4 * i + 1] = _mm512_unpackhi_epi64(t[4 * i], t[4 * i + 2]);
    r[4 * i + 2] = _mm512_unpacklo_epi64(t[4 * i + 1], t[4 * i + 3]);
    r[4 * i + 3] = _mm512_unpackhi_epi64(t[4 * i + 1], t[4 * i + 3]);
  }
  for (int c = 0; c < 4; ++c) {  // column 4L + c: lane L of r[c], r[4 + c], r[8 + c], r[12 + c]
    const __m512i x01 = _mm512_shuffle_i32x4(r[c], r[4 + c], 0x44), y01 = _mm512_shuffle_i32x4(r[8 + c], r[12 + c], 0x44);
    const __m512i x23 = _mm512_shuffle_i32x4(r[c], r[4 + c], 0xee), y23 = _mm512_shuffle_i32x4(r[8 + c], r[12 + c], 0xee);
    out[c] = _mm512_shuffle_i32x4(x01, y01, 0x88);
    out[4 + c] = _mm512_shuffle_i32x4(x01, y01, 0xdd);
    out[8 + c] = _mm512_shuffle_i32x4(x23, y23, 0x88);
    out[12 + c] = _mm512_shuffle_i32x4(x23, y23, 0xdd);
  }
}

// put(k, dwords) for k = 0, E, 2E, ... (E = kPerDword<W>) while k + E <= kc and k0 + k + E
// <= K: the dwords of w[n0 + lane][k0 + k : k0 + k + E] (transposed 16 dwords at a time, then
// gathered); returns the first k not put.
template <typename W, typename Put>
inline int64_t each_dword_t16(const Problem& p, int64_t k0, int64_t kc, int64_t n0, __mmask16 m, Put put) {
  constexpr int64_t E = kPerDword<W>, span = 16 * E;
  int64_t k = 0;
  for (; k + span <= kc && k0 + k + span <= p.K; k += span) {
    __m512i v[16];
    dwords_t16x16<W>(p, n0, k0 + k, m, v);
    for (int j = 0; j < 16; ++j) put(k + E * j, v[j]);
  }
  for (; k + E <= kc && k0 + k + E <= p.K; k += E) put(k, gather_t16<W>(p, n0, k0 + k, m));
  return k;
}

// Byte j (0..3) of each dword, sign-extended, as f32.
template <int J>
inline __m512 byte_f32(__m512i v) {
  return _mm512_cvtepi32_ps(_mm512_srai_epi32(_mm512_slli_epi32(v, 24 - 8 * J), 24));
}
// bf16 half j (0..1) of each dword as f32 (exact).
template <int J>
inline __m512 half_f32(__m512i v) {
  return _mm512_castsi512_ps(J == 0 ? _mm512_slli_epi32(v, 16) : _mm512_and_si512(v, _mm512_set1_epi32(-65536)));
}

template <typename W>
void pack_panels_f32_t(const Problem& p, int64_t k0, int64_t kc, int64_t n0, int64_t np, float* panel) {
  const int64_t cols = std::min(np * kPanel, p.N - n0);
  const W* w = weights<W>(p);
  for (int64_t c = 0; c < np * kPanel; c += 16) {
    const __mmask16 m = lane_mask(cols - c);
    float* dst = panel + strip_at(0, c);
    auto put = [&](int64_t k, __m512i v) {  // the dword of k..k + kPerDword - 1
      if constexpr (sizeof(W) == 1) {
        _mm512_store_ps(dst + (k + 0) * kPanel, byte_f32<0>(v));
        _mm512_store_ps(dst + (k + 1) * kPanel, byte_f32<1>(v));
        _mm512_store_ps(dst + (k + 2) * kPanel, byte_f32<2>(v));
        _mm512_store_ps(dst + (k + 3) * kPanel, byte_f32<3>(v));
      } else {
        _mm512_store_ps(dst + (k + 0) * kPanel, half_f32<0>(v));
        _mm512_store_ps(dst + (k + 1) * kPanel, half_f32<1>(v));
      }
    };
    int64_t k = each_dword_t16<W>(p, k0, kc, n0 + c, m, put);
    for (; k < kc; ++k)
      for (int64_t l = 0; l < 16; ++l)
        dst[k * kPanel + l] = c + l < cols && k0 + k < p.K ? wval(w[(n0 + c + l) * p.K + k0 + k]) : 0.0f;
  }
}

#if defined(QMM_AVX512_BF16)
// bf16 panels [kc / 2][64][2] (as pack_panels_bf16) from w [N, K]. int8: the dword for
// k = 2j..2j+3 gives pairs j and j + 1. bf16: the dword for k = 2j, 2j + 1 is pair j as is.
template <typename W>
void pack_panels_bf16_t(const Problem& p, int64_t k0, int64_t kc, int64_t n0, int64_t np, uint16_t* panel) {
  const int64_t cols = std::min(np * kPanel, p.N - n0);
  const W* w = weights<W>(p);
  for (int64_t c = 0; c < np * kPanel; c += 16) {
    const __mmask16 m = lane_mask(cols - c);
    uint16_t* dst = panel + (c / kPanel) * kPanelK * kPanel + (c % kPanel) * 2;
    auto put = [&](int64_t k, __m512i v) {
      if constexpr (sizeof(W) == 1) {
        _mm512_store_si512(dst + (k / 2) * kPanel * 2, bf16_pair(byte_f32<0>(v), byte_f32<1>(v)));
        _mm512_store_si512(dst + (k / 2 + 1) * kPanel * 2, bf16_pair(byte_f32<2>(v), byte_f32<3>(v)));
      } else {
        _mm512_store_si512(dst + (k / 2) * kPanel * 2, v);
      }
    };
    int64_t k = each_dword_t16<W>(p, k0, kc, n0 + c, m, put);
    for (; k < kc; k += 2) {
      alignas(64) float lo[16], hi[16];
      for (int64_t l = 0; l < 16; ++l) {
        const W* row = w + (n0 + c + l) * p.K;
        const bool live = c + l < cols;
        lo[l] = live && k0 + k < p.K ? wval(row[k0 + k]) : 0.0f;
        hi[l] = live && k0 + k + 1 < p.K ? wval(row[k0 + k + 1]) : 0.0f;
      }
      _mm512_store_si512(dst + (k / 2) * kPanel * 2, bf16_pair(_mm512_load_ps(lo), _mm512_load_ps(hi)));
    }
  }
}

template <typename W>
struct PackedBf16T : PackedBf16<W> {
  static void pack(const Problem& p, int64_t k0, int64_t kc, int64_t n0, int64_t np, uint16_t* panel) {
    pack_panels_bf16_t<W>(p, k0, kc, n0, np, panel);
  }
};
#endif

// Direct path for w [N, K] (M <= 4): dot products along the channel rows, 4 channels by MR
// rows of x per pass (16 accumulators), each summed across its lanes at the end.
template <typename W, int MR>
void direct_t_rows(const Problem& p, const float* x, int64_t n0, int64_t cols, float* acc, int64_t ld) {
  const int64_t K = p.K, full = K & ~int64_t{15};
  const __mmask16 tail = lane_mask(K - full);
  int64_t c = 0;
  for (; c < cols; c += 4) {
    const int64_t nc = std::min<int64_t>(4, cols - c);
    const W* w[4];
    for (int64_t j = 0; j < 4; ++j) w[j] = weights<W>(p) + (n0 + c + std::min<int64_t>(j, nc - 1)) * K;
    __m512 a[4][MR];
    for (int j = 0; j < 4; ++j)
      for (int m = 0; m < MR; ++m) a[j][m] = _mm512_setzero_ps();
    for (int64_t k = 0; k < full; k += 16) {
      __m512 xv[MR];
      for (int m = 0; m < MR; ++m) xv[m] = _mm512_loadu_ps(x + m * K + k);
      for (int j = 0; j < 4; ++j) {
        const __m512 wv = load_w16<false>(w[j] + k, 0);
        for (int m = 0; m < MR; ++m) a[j][m] = _mm512_fmadd_ps(xv[m], wv, a[j][m]);
      }
    }
    if (full < K) {
      __m512 xv[MR];
      for (int m = 0; m < MR; ++m) xv[m] = _mm512_maskz_loadu_ps(tail, x + m * K + full);
      for (int j = 0; j < 4; ++j) {
        const __m512 wv = load_w16<true>(w[j] + full, tail);
        for (int m = 0; m < MR; ++m) a[j][m] = _mm512_fmadd_ps(xv[m], wv, a[j][m]);
      }
    }
    for (int64_t j = 0; j < nc; ++j)
      for (int m = 0; m < MR; ++m) acc[m * ld + c + j] = _mm512_reduce_add_ps(a[j][m]);
  }
}

template <typename W>
void direct_t_item(const Problem& p, int64_t item) {
  const int64_t c0 = item * p.cw, cols = std::min(p.cw, p.N - c0);
  thread_local std::vector<float> own;
  const int64_t ld = (cols + 15) / 16 * 16;
  own.resize(p.M * ld);
  for (int64_t m0 = 0; m0 < p.M; m0 += kDirectGroup) {
    const int64_t rows = std::min(kDirectGroup, p.M - m0);
    const float* x = p.x + m0 * p.K;
    float* acc = own.data() + m0 * ld;
    switch (rows) {
      case 1: direct_t_rows<W, 1>(p, x, c0, cols, acc, ld); break;
      case 2: direct_t_rows<W, 2>(p, x, c0, cols, acc, ld); break;
      case 3: direct_t_rows<W, 3>(p, x, c0, cols, acc, ld); break;
      default: direct_t_rows<W, 4>(p, x, c0, cols, acc, ld); break;
    }
  }
  store_tile(p, own.data(), ld, 0, p.M, c0, cols);
}

#endif  // QMM_AVX512

#if defined(QMM_AVX2)

// ---- Packed path on AVX2 + FMA (no AVX-512): f32 panels in 16-column strips, a 6 x 16 tile ----
//
// A 64-column panel is held as 4 strips [kc][16] f32 (`kStrip`, `strip_at`): the micro
// kernel's 6 rows x 2 vectors of accumulators (12 of the 16 ymm registers; the 2 weight
// vectors and the broadcast in the rest) read one strip as a contiguous stream. bf16 x is
// widened to f32 first (`prepare_rows`): without bf16 dot products every product is f32.

// The vector width of `store_widened` (pack_panels_f32).
constexpr int64_t kWidenLanes = 8;
// dst[0:8] = src[0:8] widened to f32, lanes at or past `remaining` 0 (read nothing).
template <typename W>
inline void store_widened(const W* src, int64_t remaining, float* dst) {
  if (remaining >= 8) return _mm256_store_ps(dst, load_w8(src));
  for (int64_t l = 0; l < 8; ++l) dst[l] = l < remaining ? wval(src[l]) : 0.0f;
}

// The same panels from w [N, K] (a tied embedding read as the LM head): each channel's row is
// read along k and written down its strip column. Scalar: the serving layouts read a tied
// head [K, N] (`cpu_weight_layout`), so this layout is not on a hot path.
template <typename W>
void pack_panels_f32_t(const Problem& p, int64_t k0, int64_t kc, int64_t n0, int64_t np, float* panel) {
  const int64_t cols = std::min(np * kPanel, p.N - n0);
  for (int64_t c = 0; c < np * kPanel; ++c) {
    const W* row = weights<W>(p) + (n0 + c) * p.K + k0;
    for (int64_t k = 0; k < kc; ++k) panel[strip_at(k, c)] = c < cols ? wval(row[k]) : 0.0f;
  }
}

// c[MR][16] (+)= a[0:MR, 0:kc] @ strip[0:kc][16]; a rows lda floats apart, c rows ldc apart
// (the AVX-512 kernel's signature, a quarter of its columns).
template <int MR>
void packed_tile_f32(const float* a, int64_t lda, const float* strip, int64_t kc, float* c, int64_t ldc,
                     bool accumulate) {
  __m256 acc[MR][2];
#pragma GCC unroll 8
  for (int m = 0; m < MR; ++m)
#pragma GCC unroll 2
    for (int v = 0; v < 2; ++v) acc[m][v] = accumulate ? _mm256_loadu_ps(c + m * ldc + 8 * v) : _mm256_setzero_ps();
  const float* b = strip;
  for (int64_t k = 0; k < kc; ++k, b += kStrip) {
    const __m256 b0 = _mm256_load_ps(b), b1 = _mm256_load_ps(b + 8);
#pragma GCC unroll 8
    for (int m = 0; m < MR; ++m) {
      const __m256 x = _mm256_broadcast_ss(a + m * lda + k);
      acc[m][0] = _mm256_fmadd_ps(x, b0, acc[m][0]);
      acc[m][1] = _mm256_fmadd_ps(x, b1, acc[m][1]);
    }
  }
#pragma GCC unroll 8
  for (int m = 0; m < MR; ++m)
#pragma GCC unroll 2
    for (int v = 0; v < 2; ++v) _mm256_storeu_ps(c + m * ldc + 8 * v, acc[m][v]);
}

#endif  // QMM_AVX2

#if defined(QMM_PACKED)

// ---- Packed path, f32 products (both ISAs: their micro kernels and strip widths differ) ----

// Widen w[k0:k0 + kc, n0:n0 + 64 * np] into np panels of strips (`strip_at`; columns past N
// are 0). Row by row: each row's np * 64 weights are one contiguous read (reading a 64-column
// panel down its rows, N bytes apart, measured 3x slower).
template <typename W>
void pack_panels_f32(const Problem& p, int64_t k0, int64_t kc, int64_t n0, int64_t np, float* panel) {
  const int64_t cols = std::min(np * kPanel, p.N - n0);
  for (int64_t k = 0; k < kc; ++k) {
    const W* row = weights<W>(p) + (k0 + k) * p.N + n0;
    if (k + kPackAhead < kc)
      for (int64_t c = 0; c < cols; c += 64 / sizeof(W)) _mm_prefetch(reinterpret_cast<const char*>(row + kPackAhead * p.N + c), _MM_HINT_T0);
    for (int64_t q = 0; q < np; ++q)
      for (int64_t st = 0; st < kPanel / kStrip; ++st) {  // constant trip counts: unrolled
        const int64_t c = q * kPanel + st * kStrip;
        float* dst = panel + strip_at(k, c);
        for (int64_t l = 0; l < kStrip; l += kWidenLanes) store_widened(row + c + l, cols - c - l, dst + l);
      }
  }
}

template <typename W>
struct PackedF32 {
  using Panel = float;
  static constexpr bool kPairs = false;
  static constexpr int64_t kStrips = kPanel / kStrip;  // a panel's strips, each run over every row tile
  static void pack(const Problem& p, int64_t k0, int64_t kc, int64_t n0, int64_t np, Panel* panel) {
    pack_panels_f32<W>(p, k0, kc, n0, np, panel);
  }
  // Strip `strip` of the panel into columns [kStrip * strip, kStrip * (strip + 1)) of c's rows.
  template <int MR>
  static void tile(const Problem& p, int64_t m, int64_t k0, int64_t kc, const Panel* panel, int64_t strip, float* c,
                   bool acc) {
    packed_tile_f32<MR>(p.x + m * p.K + k0, p.K, panel + strip * kPanelK * kStrip, kc, c + strip * kStrip, kPanel, acc);
  }
};

// The same panels from w [N, K] (a tied embedding read as the LM head).
template <typename W>
struct PackedF32T : PackedF32<W> {
  static void pack(const Problem& p, int64_t k0, int64_t kc, int64_t n0, int64_t np, float* panel) {
    pack_panels_f32_t<W>(p, k0, kc, n0, np, panel);
  }
};

// One cache line into L2 (prefetcht1). As inline asm: GCC 12 deletes loops whose only effect
// is `_mm_prefetch` (seen in the attention kernel's page prefetch).
inline void prefetch_l2(const char* p) {
#if defined(__x86_64__)
  asm volatile("prefetcht1 %0" : : "m"(*p));
#else
  __builtin_prefetch(p, 0, 2);
#endif
}

// The weight bytes of a packed block, walked in 64-byte lines and asked into L2 a few at a
// time, so that the next block arrives while this one's micro kernels run (the packing
// otherwise waits on DRAM with nothing to overlap).
struct BlockPrefetch {
  const char* base = nullptr;
  int64_t rows = 0, lines = 0, stride = 0;  // rows of `lines` lines, `stride` bytes apart
  int64_t row = 0, line = 0;                // the next line to ask for
  // Block [k0, k0 + kc) x [n0, n0 + cols) of w ([K, N], or [N, K] when transposed).
  BlockPrefetch(const Problem& p, int64_t k0, int64_t kc, int64_t n0, int64_t cols) {
    if (k0 >= p.K) return;
    kc = std::min(kc, p.K - k0);
    const int64_t r0 = p.wt ? n0 : k0, c0 = p.wt ? k0 : n0;
    rows = p.wt ? cols : kc;
    const int64_t per_row = p.wt ? kc : cols;  // weights of a row of the block
    stride = (p.wt ? p.K : p.N) * p.wsize;
    base = static_cast<const char*>(p.w) + r0 * stride + c0 * p.wsize;
    lines = (per_row * p.wsize + 63) / 64;
  }
  int64_t total() const { return rows * lines; }
  void issue(int64_t count) {
    for (; count > 0 && row < rows; --count) {
      prefetch_l2(base + row * stride + line * 64);
      if (++line == lines) line = 0, ++row;
    }
  }
};

// One packed item: rows [m0, m0 + rows) by np 64-column panels, over K in kPanelK blocks:
// the panels of a block are packed together (contiguous row reads), then each panel runs
// over the m-block's row tiles.
template <typename Path>
void packed_item(const Problem& p, int64_t item) {
  using Panel = typename Path::Panel;
  thread_local std::vector<Panel> panel_storage;
  thread_local std::vector<float> acc_storage;
  const PackedItem& it = p.packed[item];
  const int64_t m0 = it.m0, rows = it.rows;
  const int64_t n0 = it.span * p.span_panels * kPanel;
  const int64_t np = std::min(p.span_panels, (p.N - n0 + kPanel - 1) / kPanel);
  panel_storage.resize(np * kPanelK * kPanel + 64);
  Panel* panels = reinterpret_cast<Panel*>((reinterpret_cast<uintptr_t>(panel_storage.data()) + 63) &
                                           ~static_cast<uintptr_t>(63));
  acc_storage.resize(np * rows * kPanel);
  if (p.K == 0) std::fill(acc_storage.begin(), acc_storage.end(), 0.0f);
  for (int64_t k0 = 0; k0 < p.K; k0 += kPanelK) {
    int64_t kc = std::min(kPanelK, p.K - k0);
    if (Path::kPairs) kc += kc & 1;
    Path::pack(p, k0, kc, n0, np, panels);
    const bool accumulate = k0 > 0;
    // This item's next block, asked into L2 a little before each row tile.
    BlockPrefetch next(p, k0 + kPanelK, kPanelK, n0, std::min(np * kPanel, p.N - n0));
    const int64_t tiles = np * Path::kStrips * ((rows + kPackedRows - 1) / kPackedRows);
    const int64_t per_tile = (next.total() + tiles - 1) / tiles;
    for (int64_t q = 0; q < np; ++q) {
      const Panel* panel = panels + q * kPanelK * kPanel;
      float* acc = acc_storage.data() + q * rows * kPanel;
      for (int64_t st = 0; st < Path::kStrips; ++st) {  // a strip over every row tile
        int64_t i = 0;
        for (; i + kPackedRows <= rows; i += kPackedRows) {
          next.issue(per_tile);
          Path::template tile<kPackedRows>(p, m0 + i, k0, kc, panel, st, acc + i * kPanel, accumulate);
        }
        next.issue(per_tile);
        float* c = acc + i * kPanel;
        switch (rows - i) {
          case 5: Path::template tile<5>(p, m0 + i, k0, kc, panel, st, c, accumulate); break;
          case 4: Path::template tile<4>(p, m0 + i, k0, kc, panel, st, c, accumulate); break;
          case 3: Path::template tile<3>(p, m0 + i, k0, kc, panel, st, c, accumulate); break;
          case 2: Path::template tile<2>(p, m0 + i, k0, kc, panel, st, c, accumulate); break;
          case 1: Path::template tile<1>(p, m0 + i, k0, kc, panel, st, c, accumulate); break;
          default: break;
        }
      }
    }
  }
  for (int64_t q = 0; q < np; ++q)
    store_tile(p, acc_storage.data() + q * rows * kPanel, kPanel, m0, rows, n0 + q * kPanel,
               std::min(kPanel, p.N - n0 - q * kPanel));
}

#endif  // QMM_PACKED

template <typename W>
void run_item_w(const Problem& p, int64_t item) {
#if defined(QMM_PACKED)
  if (p.packed_path) {
#if defined(QMM_AVX512_BF16)
    if (p.xb != nullptr) return p.wt ? packed_item<PackedBf16T<W>>(p, item) : packed_item<PackedBf16<W>>(p, item);
#endif
    return p.wt ? packed_item<PackedF32T<W>>(p, item) : packed_item<PackedF32<W>>(p, item);
  }
#endif
#if defined(QMM_AVX512)
  if (p.wt) return direct_t_item<W>(p, item);
#endif
  if (p.wt) return direct_t_item_any<W>(p, item);
  direct_item<W>(p, item);
}

void run_item(const Problem& p, int64_t item) {
  return p.w_bf16 ? run_item_w<uint16_t>(p, item) : run_item_w<int8_t>(p, item);
}

struct Progress {  // shared with pool tasks, which may start after the call returned
  std::atomic<int64_t> next{0};
  std::atomic<int64_t> done{0};
};

// fn(i) for i in [0, count), on the calling thread and the pool's threads, as many as the
// pool has (one per core): more would share cores (measured slower).
template <typename F>
void parallel_for(int64_t count, ffi::ThreadPool& pool, const F& fn) {
  auto progress = std::make_shared<Progress>();
  // Pool tasks hold `progress` only; they touch fn (and the buffers) just while holding an
  // item, and the call returns only when every item is done.
  auto work = [&fn, count](Progress& pr) {
    for (int64_t i; (i = pr.next.fetch_add(1)) < count;) {
      fn(i);
      pr.done.fetch_add(1);
    }
  };
  const int64_t helpers = std::clamp<int64_t>(pool.num_threads() - 1, 0, count - 1);
  for (int64_t i = 0; i < helpers; ++i) pool.Schedule([progress, work]() { work(*progress); });
  work(*progress);
  while (progress->done.load() < count) std::this_thread::yield();
}

void run(const Problem& p, int64_t items, ffi::ThreadPool& pool) {
  parallel_for(items, pool, [&p](int64_t i) { run_item(p, i); });
}

// The direct path's split: column parts of at most kDirectCols (one part when N fits, so
// that an item's weight rows are one contiguous block), and the rows of K in enough parts to
// give every worker about two items, none under kDirectMinRows rows.
void direct_split(Problem& p, int64_t workers) {
  p.nparts = (p.N + kDirectCols - 1) / kDirectCols;
  p.cw = p.nparts == 1 ? p.N : ((p.N + p.nparts - 1) / p.nparts + 63) / 64 * 64;
  p.nparts = (p.N + p.cw - 1) / p.cw;
  const int64_t wanted = (2 * workers + p.nparts - 1) / p.nparts;
  const int64_t kparts = std::clamp<int64_t>(wanted, 1, std::max<int64_t>(1, p.K / kDirectMinRows));
  p.krows = std::max<int64_t>(8, ((p.K + kparts - 1) / kparts + 7) / 8 * 8);
  p.kparts = std::max<int64_t>(1, (p.K + p.krows - 1) / p.krows);
}

// The packed path's items: m-blocks of about kMBlock rows (as even as whole 6-row tiles
// allow) by spans of panels, as many panels per span as leave every worker about four items.
// When few items do not divide among the workers, the last ones are split by rows, one part
// per worker (their panels are packed once per part): 9 items on 2 workers took 5 item-times,
// now 4.5. Every output element is still computed by one item, in the same order.
void packed_items(Problem& p, int64_t workers, std::vector<PackedItem>& out) {
  const int64_t blocks = (p.M + kMBlock - 1) / kMBlock;
  const int64_t per = (p.M + blocks - 1) / blocks;
  const int64_t m_block = (per + kPackedRows - 1) / kPackedRows * kPackedRows;
  const int64_t num_m_blocks = (p.M + m_block - 1) / m_block;
  const int64_t panels = (p.N + kPanel - 1) / kPanel;
  p.span_panels = std::clamp<int64_t>(num_m_blocks * panels / (4 * workers), 1, kMaxSpan);
  const int64_t spans = (panels + p.span_panels - 1) / p.span_panels;
  out.clear();
  for (int64_t sb = 0; sb < spans; ++sb)
    for (int64_t mb = 0; mb < num_m_blocks; ++mb)
      out.push_back({mb * m_block, std::min(m_block, p.M - mb * m_block), sb});
  const int64_t count = static_cast<int64_t>(out.size()), extra = count % workers;
  if (extra == 0 || count >= 8 * workers) return;
  std::vector<PackedItem> tail(out.end() - extra, out.end());
  out.resize(count - extra);
  for (const PackedItem& it : tail) {
    const int64_t tiles = (it.rows + kPackedRows - 1) / kPackedRows;
    const int64_t part = (tiles + workers - 1) / workers * kPackedRows;
    for (int64_t r = 0; r < it.rows; r += part) out.push_back({it.m0 + r, std::min(part, it.rows - r), it.span});
  }
}

// What a call's activations are prepared from and into (see prepare_rows).
struct Prep {
  const float* xf = nullptr;        // x [M, K] f32, or
  const uint16_t* xh = nullptr;     // x [M, K] bf16
  uint16_t* x16 = nullptr;          // into x16 [M, Kp] bf16 (the packed bf16 path), or
  float* x32 = nullptr;             // into x32 [M, K] as f32 values of bf16 (or bf16-rounded f32)
  int64_t K = 0, Kp = 0;
};

// Rows [m0, m1) of the activations in the form the chosen path reads.
void prepare_rows(const Prep& q, int64_t m0, int64_t m1) {
  const int64_t K = q.K;
  thread_local std::vector<uint16_t> row16;
  row16.resize(K);
  for (int64_t m = m0; m < m1; ++m) {
    const float* src = q.xf != nullptr ? q.xf + m * K : nullptr;  // f32 x: the row
    if (q.x16 != nullptr) {  // bf16 rows padded to an even length
      uint16_t* dst = q.x16 + m * q.Kp;
      if (src != nullptr) round_to_bf16(src, dst, K);
      else std::memcpy(dst, q.xh + m * K, K * sizeof(uint16_t));
      if (q.Kp > K) dst[K] = 0;
    } else {  // f32 values of bf16 (or bf16-rounded) activations
      if (src != nullptr) {
        round_to_bf16(src, row16.data(), K);
        to_f32(row16.data(), q.x32 + m * K, K);
      } else {
        to_f32(q.xh + m * K, q.x32 + m * K, K);
      }
    }
  }
}

// ---- The gated activation's pass (the ...Glu target) ----
enum Glu : int64_t { kGluNone = 0, kGluSilu = 1 };

// silu(g) * u as XLA expands jax.nn.silu (g * (1 / (1 + exp(-g)))), in f32.
inline float silu_times(float g, float u) { return g * (1.0f / (1.0f + std::exp(-g))) * u; }

#if defined(QMM_AVX512)
// f32 -> the nearest bf16 (ties to even; NaN stays NaN, quiet) as f32: f32_to_bf16's rounding.
inline __m512 round_bf16_16(__m512 v) {
  const __m512i b = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(b, 16), _mm512_set1_epi32(1));
  __m512i r = _mm512_add_epi32(b, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff)));
  r = _mm512_mask_mov_epi32(r, _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), _mm512_set1_epi32(0x7fc00000));
  return _mm512_castsi512_ps(_mm512_and_si512(r, _mm512_set1_epi32(static_cast<int>(0xffff0000u))));
}
#elif defined(QMM_AVX2)
inline __m256 round_bf16_8(__m256 v) {
  const __m256i b = _mm256_castps_si256(v);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(b, 16), _mm256_set1_epi32(1));
  __m256i r = _mm256_add_epi32(b, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7fff)));
  r = _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7fc00000), _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q)));
  return _mm256_castsi256_ps(_mm256_and_si256(r, _mm256_set1_epi32(static_cast<int>(0xffff0000u))));
}
#endif

// Rows [m0, m1) of out [M, N / 2] from the scaled sums s [M, N] (`round`: g and u rounded to
// bf16 first, as the plain call's bf16 out holds them; out bf16 or f32).
void glu_rows(const float* s, int64_t N, bool round, bool out_bf16, void* out, int64_t m0, int64_t m1) {
  const int64_t H = N / 2;
  for (int64_t m = m0; m < m1; ++m) {
    const float* g = s + m * N;
    const float* u = g + H;
    int64_t j = 0;
#if defined(QMM_AVX512)
    const __m512 one = _mm512_set1_ps(1.0f);
    for (; j + 16 <= H; j += 16) {
      __m512 gv = _mm512_loadu_ps(g + j), uv = _mm512_loadu_ps(u + j);
      if (round) {
        gv = round_bf16_16(gv);
        uv = round_bf16_16(uv);
      }
      const __m512 e = jaxserve_native::exp16(_mm512_sub_ps(_mm512_setzero_ps(), gv));
      const __m512 y = _mm512_mul_ps(_mm512_mul_ps(gv, _mm512_div_ps(one, _mm512_add_ps(one, e))), uv);
      if (out_bf16) {
        const __m512i h = _mm512_srli_epi32(_mm512_castps_si512(round_bf16_16(y)), 16);
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(static_cast<uint16_t*>(out) + m * H + j),
                            _mm512_cvtepi32_epi16(h));
      } else {
        _mm512_storeu_ps(static_cast<float*>(out) + m * H + j, y);
      }
    }
#elif defined(QMM_AVX2)
    const __m256 one = _mm256_set1_ps(1.0f);
    for (; j + 8 <= H; j += 8) {
      __m256 gv = _mm256_loadu_ps(g + j), uv = _mm256_loadu_ps(u + j);
      if (round) {
        gv = round_bf16_8(gv);
        uv = round_bf16_8(uv);
      }
      const __m256 e = jaxserve_native::exp8(_mm256_sub_ps(_mm256_setzero_ps(), gv));
      const __m256 y = _mm256_mul_ps(_mm256_mul_ps(gv, _mm256_div_ps(one, _mm256_add_ps(one, e))), uv);
      if (out_bf16) {
        const __m256i h = _mm256_srli_epi32(_mm256_castps_si256(round_bf16_8(y)), 16);
        const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(h, h), 0x08);
        _mm_storeu_si128(reinterpret_cast<__m128i*>(static_cast<uint16_t*>(out) + m * H + j),
                         _mm256_castsi256_si128(packed));
      } else {
        _mm256_storeu_ps(static_cast<float*>(out) + m * H + j, y);
      }
    }
#endif
    for (; j < H; ++j) {
      float gj = g[j], uj = u[j];
      if (round) {
        gj = bf16_to_f32(f32_to_bf16(gj));
        uj = bf16_to_f32(f32_to_bf16(uj));
      }
      const float y = silu_times(gj, uj);
      if (out_bf16) static_cast<uint16_t*>(out)[m * H + j] = f32_to_bf16(y);
      else static_cast<float*>(out)[m * H + j] = y;
    }
  }
}

// Splits the problem into items (packed: m-blocks x panel spans; direct: k-parts x column
// parts, or column parts of w [N, K]) and runs them on the calling thread and the pool.
void run_problem(Problem& p, ffi::ThreadPool& pool) {
  const int64_t workers = std::max<int64_t>(1, pool.num_threads());
  int64_t items;
  thread_local std::vector<float> partial;
  thread_local std::vector<PackedItem> packed;
  std::unique_ptr<std::atomic<int64_t>[]> parts_done;
#if defined(QMM_PACKED)
  if (p.packed_path) {
    packed_items(p, workers, packed);
    p.packed = packed.data();
    items = static_cast<int64_t>(packed.size());
  } else
#endif
  if (p.wt) {  // column parts only: each channel's dot product runs along its own row
    Problem split = p;  // the k-parts w [K, N] would be cut in (`direct_t_item_any` follows them)
    direct_split(split, workers);
    p.krows = split.krows;
    p.cw = std::clamp<int64_t>((p.N + 4 * workers - 1) / (4 * workers), 64, 1024) / 4 * 4;
    items = (p.N + p.cw - 1) / p.cw;
  } else {
    direct_split(p, workers);
    items = p.nparts * p.kparts;
    if (p.kparts > 1) {
      partial.resize(p.kparts * p.M * p.N);
      p.partial = partial.data();
      parts_done.reset(new std::atomic<int64_t>[p.nparts]);
      for (int64_t i = 0; i < p.nparts; ++i) parts_done[i].store(0, std::memory_order_relaxed);
      p.parts_done = parts_done.get();
    }
  }
  run(p, items, pool);
}

ffi::Error Matmul(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::AnyBuffer w, ffi::Buffer<ffi::F32> scale,
                  ffi::Buffer<ffi::S32> layer, ffi::Buffer<ffi::S32> live, const ffi::AnyBuffer* residual,
                  ffi::Result<ffi::AnyBuffer> out, bool bf16_products, bool w_transposed, int64_t glu = kGluNone) {
  const auto xd = x.dimensions(), wd = w.dimensions(), sd = scale.dimensions();
  const auto wtype = w.element_type();
  if (wtype != ffi::S8 && wtype != ffi::BF16) return ffi::Error::InvalidArgument("w must be int8 or bfloat16");
  // bf16 weights may come without a scale: scale of 0 elements.
  const bool scaled = !(wtype == ffi::BF16 && scale.element_count() == 0);
  if (xd.size() != 2 || (wd.size() != 2 && wd.size() != 3) || (scaled && sd.size() + 1 != wd.size()))
    return ffi::Error::InvalidArgument("expected x [M, K], w [K, N] or [L, K, N], scale [N] or [L, N]");
  const bool stacked = wd.size() == 3;
  if (stacked && w_transposed) return ffi::Error::InvalidArgument("w_transposed takes an unstacked w [N, K]");
  const int64_t L = stacked ? wd[0] : 1;
  const int64_t K = w_transposed ? wd[1] : wd[stacked ? 1 : 0], N = w_transposed ? wd[0] : wd[stacked ? 2 : 1];
  if (xd[1] != K || (scaled && (sd[sd.size() - 1] != N || (stacked && sd[0] != L))) || layer.element_count() != 1)
    return ffi::Error::InvalidArgument("x, w and scale shapes disagree");
  if (live.element_count() != 1) return ffi::Error::InvalidArgument("rows must be an int32 scalar");
  const auto xt = x.element_type(), ot = out->element_type();
  // out in x's dtype, or f32 from bf16 x (a head's logits: the f32 sums not rounded to bf16)
  if ((xt != ffi::F32 && xt != ffi::BF16) || (ot != xt && ot != ffi::F32))
    return ffi::Error::InvalidArgument("x must be float32 or bfloat16, out x's dtype or float32");
  const int64_t padded_m = xd[0];
  if (residual != nullptr) {
    const auto rd = residual->dimensions();
    if (residual->element_type() != ot || rd.size() != 2 || rd[0] != padded_m || rd[1] != N)
      return ffi::Error::InvalidArgument("residual must be [M, N] in out's dtype");
  }
  if (glu != kGluNone) {
    if (glu != kGluSilu) return ffi::Error::InvalidArgument("glu must be 1 (silu)");
    if (N % 2 != 0 || residual != nullptr || w_transposed || ot != xt)
      return ffi::Error::InvalidArgument("a gated activation takes an even N, no residual, w [K, N], out in x's dtype");
  }
  const auto od = out->dimensions();
  const int64_t out_n = glu != kGluNone ? N / 2 : N;
  if (od.size() != 2 || od[0] != padded_m || od[1] != out_n)
    return ffi::Error::InvalidArgument(glu != kGluNone ? "out must be [M, N / 2]" : "out must be [M, N]");
  if (padded_m == 0 || N == 0) return ffi::Error::Success();
  // Rows past the live ones are 0 and cost nothing else.
  const int64_t M = std::clamp<int64_t>(live.typed_data()[0], 0, padded_m);
  const size_t elt = ot == ffi::BF16 ? 2 : 4;
  std::memset(static_cast<char*>(out->untyped_data()) + M * out_n * elt, 0, (padded_m - M) * out_n * elt);
  if (M == 0) return ffi::Error::Success();
  // The layer as dynamic_index_in_dim takes it: negative counts from the end, then clamped.
  int64_t l = layer.typed_data()[0];
  if (l < 0) l += L;
  l = std::clamp<int64_t>(l, 0, L - 1);

  Problem p;
  p.M = M;
  p.K = K;
  p.N = N;
  p.w_bf16 = wtype == ffi::BF16;
  p.wsize = p.w_bf16 ? 2 : 1;
  p.w = static_cast<const char*>(w.untyped_data()) + l * K * N * p.wsize;
  p.wt = w_transposed;
  p.scale = scaled ? scale.typed_data() + l * N : nullptr;
  p.out = out->untyped_data();  // a gated call's chunks write to their scratch instead (below)
  p.out_bf16 = ot == ffi::BF16;
  p.packed_path = padded_m > kDirectMaxRows;
  p.residual = residual != nullptr ? residual->untyped_data() : nullptr;
  p.xb = nullptr;
  p.Kp = K + (K & 1);
  const bool bf16_x = xt == ffi::BF16 || bf16_products;
  Prep q;
  q.xf = xt == ffi::F32 ? static_cast<const float*>(x.untyped_data()) : nullptr;
  q.xh = xt == ffi::BF16 ? static_cast<const uint16_t*>(x.untyped_data()) : nullptr;
  q.K = K;
  q.Kp = p.Kp;
#if defined(QMM_AVX512_BF16)
  const bool packed_bf16 = p.packed_path && bf16_x;
#else
  const bool packed_bf16 = false;
#endif
  // The activations in the form the chosen path reads, prepared once per call (f32 x as
  // given needs nothing).
  thread_local std::vector<float> x32;
  thread_local std::vector<uint16_t> x16;
  if (packed_bf16) {
    x16.resize(M * p.Kp);
    q.x16 = x16.data();
    p.xb = x16.data();
    p.x = nullptr;
  } else if (q.xh != nullptr || bf16_x) {
    x32.resize(M * K);
    q.x32 = x32.data();
    p.x = x32.data();
  } else {
    p.x = q.xf;
  }
  if (q.x16 != nullptr || q.x32 != nullptr) {
    // In parallel past ~64k values (a prefill's rows); row blocks of 16.
    const int64_t blocks = M * K >= (1 << 16) ? (M + 15) / 16 : 1;
    const int64_t per = (M + blocks - 1) / blocks;
    if (blocks == 1) prepare_rows(q, 0, M);
    else parallel_for(blocks, pool, [&q, per, M](int64_t b) { prepare_rows(q, b * per, std::min(M, (b + 1) * per)); });
  }
  if (glu == kGluNone) {
    run_problem(p, pool);
    return ffi::Error::Success();
  }
  // Gated: row chunks of at most kGluRows, so that the f32 scratch stays [kGluRows, N] (and
  // in cache for the gated pass) however many rows a prefill has. A chunk of the packed path
  // is whole m-blocks, so the weight panels are packed as often as in one call.
  thread_local std::vector<float> gated_sums;
  const float* x_rows = p.x;
  const uint16_t* xb_rows = p.xb;
  const int64_t H = N / 2;
  for (int64_t c0 = 0; c0 < M; c0 += kGluRows) {
    Problem q = p;
    q.M = std::min(kGluRows, M - c0);
    q.x = x_rows != nullptr ? x_rows + c0 * K : nullptr;
    q.xb = xb_rows != nullptr ? xb_rows + c0 * p.Kp : nullptr;
    gated_sums.resize(q.M * N);
    q.out = gated_sums.data();
    q.out_bf16 = false;
    run_problem(q, pool);
    const bool bf16 = ot == ffi::BF16;  // g and u rounded as the plain call's bf16 out holds them
    const float* sums = gated_sums.data();
    void* o = static_cast<char*>(out->untyped_data()) + c0 * H * elt;
    // In parallel past ~32k outputs (a prefill's rows); row blocks of 16.
    const int64_t rows = q.M, blocks = rows * H >= (1 << 15) ? (rows + 15) / 16 : 1;
    if (blocks == 1) glu_rows(sums, N, bf16, bf16, o, 0, rows);
    else
      parallel_for(blocks, pool, [=](int64_t b) { glu_rows(sums, N, bf16, bf16, o, b * 16, std::min(rows, (b + 1) * 16)); });
  }
  return ffi::Error::Success();
}

ffi::Error Impl(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::AnyBuffer w, ffi::Buffer<ffi::F32> scale,
                ffi::Buffer<ffi::S32> layer, ffi::Buffer<ffi::S32> live, ffi::Result<ffi::AnyBuffer> out,
                bool bf16_products, bool w_transposed) {
  return Matmul(pool, x, w, scale, layer, live, nullptr, out, bf16_products, w_transposed);
}

ffi::Error ImplResidual(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::AnyBuffer w, ffi::Buffer<ffi::F32> scale,
                        ffi::Buffer<ffi::S32> layer, ffi::Buffer<ffi::S32> live, ffi::AnyBuffer residual,
                        ffi::Result<ffi::AnyBuffer> out, bool bf16_products, bool w_transposed) {
  return Matmul(pool, x, w, scale, layer, live, &residual, out, bf16_products, w_transposed);
}

ffi::Error ImplGlu(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::AnyBuffer w, ffi::Buffer<ffi::F32> scale,
                   ffi::Buffer<ffi::S32> layer, ffi::Buffer<ffi::S32> live, ffi::Result<ffi::AnyBuffer> out,
                   bool bf16_products, bool w_transposed, int64_t glu) {
  return Matmul(pool, x, w, scale, layer, live, nullptr, out, bf16_products, w_transposed, glu);
}

// The operands every target takes first.
auto bind_operands() {
  return ffi::Ffi::Bind()
      .Ctx<ffi::ThreadPool>()
      .Arg<ffi::AnyBuffer>()          // x [M, K] f32 / bf16
      .Arg<ffi::AnyBuffer>()          // w [K, N] or [L, K, N]: int8, or bf16
      .Arg<ffi::Buffer<ffi::F32>>()   // scale [N] or [L, N] (bf16 w: may be [0], no scale)
      .Arg<ffi::Buffer<ffi::S32>>()   // layer [] (0 when unstacked)
      .Arg<ffi::Buffer<ffi::S32>>();  // rows []: the live rows (the rest of out is 0)
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxserveQuantizedMatmulCpu, Impl,
                              bind_operands()
                                  .Ret<ffi::AnyBuffer>()          // out [M, N]
                                  .Attr<bool>("bf16_products")
                                  .Attr<bool>("w_transposed"));  // w [N, K] (unstacked)

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxserveQuantizedMatmulCpuResidual, ImplResidual,
                              bind_operands()
                                  .Arg<ffi::AnyBuffer>()          // residual [M, N], x's dtype
                                  .Ret<ffi::AnyBuffer>()          // out [M, N] = residual + x @ w * scale
                                  .Attr<bool>("bf16_products")
                                  .Attr<bool>("w_transposed"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxserveQuantizedMatmulCpuGlu, ImplGlu,
                              bind_operands()
                                  .Ret<ffi::AnyBuffer>()          // out [M, N / 2] = act(g) * u
                                  .Attr<bool>("bf16_products")
                                  .Attr<bool>("w_transposed")
                                  .Attr<int64_t>("glu"));         // 1: silu

// The instruction set this build's inner loops were compiled for (the test log and `jaxserve
// info` name it, so a result says which path produced it).
extern "C" const char* JaxserveQuantizedMatmulCpuIsa() {
#if defined(QMM_AVX512_BF16)
  return "avx512+avx512_bf16";
#elif defined(QMM_AVX512)
  return "avx512";
#elif defined(__AVX2__)
  return "avx2";  // the packed path's ymm tile; the direct path's portable loops vectorised for AVX2
#else
  return "generic (compiler-vectorised)";
#endif
}
