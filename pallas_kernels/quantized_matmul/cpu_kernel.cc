// Weight-only int8 matmul for XLA:CPU, as an XLA FFI custom call.
//
//   out[m, n] = (sum_k x[m, k] * w[k, n]) * scale[n]      (f32 accumulation)
//
// x [M, K] f32 or bf16, w [K, N] int8 or stacked [L, K, N] with an int32 `layer` operand
// (read in place: no slice is copied), scale [N] or [L, N] f32, out [M, N] in x's dtype.
// XLA:CPU converts the whole int8 weight into an f32 temporary on every call and then runs
// an f32 GEMM, so int8 is slower than f32 there; this kernel reads each int8 weight once per
// row block and widens it in registers.
//
// Two paths, both f32 FMAs (no activation quantization: the result matches the reference up
// to summation order):
// - Direct (M <= 4, decode): a tile of MR = M rows by NV * 16 columns keeps MR * NV
//   accumulators in registers over all of K; each k row of the weight is read once (NV * 16
//   contiguous bytes), widened int8 -> int32 -> f32 and multiplied into every row. Bound by
//   memory bandwidth on the weight.
// - Packed (M > 4): a tile of up to kPanelK rows of a 64-column panel of the weight is
//   widened once into an f32 buffer (L2-resident), then a 6 x 64 register-blocked micro
//   kernel runs over every 6-row tile of an m-block (GEMM blocking: the conversion is paid
//   once per m-block, not per row tile). Partial sums live in a per-item f32 scratch.
//
// Work items (column tiles; for the packed path m-block x 64-column panels) are taken from a
// shared atomic counter by the calling thread and XLA's intra-op pool (ffi::ThreadPool), as
// in the attention kernel: pool tasks hold only the counter, and the call returns when every
// item is done.

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <memory>
#include <thread>
#include <vector>

#include "xla/ffi/api/ffi.h"

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define QMM_AVX512 1
#include <immintrin.h>
#endif

namespace ffi = xla::ffi;

namespace {

constexpr int64_t kDirectMaxRows = 4;  // M at or below this: the direct path
constexpr int64_t kPackedRows = 6;     // rows of the packed micro kernel's register tile
constexpr int64_t kPanel = 64;         // columns of a packed panel
constexpr int64_t kPanelK = 384;       // k rows of one packed panel tile (96 KiB of f32)
constexpr int64_t kMBlock = 48;        // target rows of one packed m-block (a multiple of 6)

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

struct Problem {
  int64_t M, K, N;
  const float* x;     // [M, K] f32 (bf16 inputs are widened first)
  const int8_t* w;    // [K, N] of the selected layer
  const float* scale; // [N]
  void* out;          // [M, N]
  bool out_bf16;
  // Direct path: column tile width in 16-lane vectors. Packed path: m-block rows.
  int64_t nv, num_col_tiles, m_block, num_m_blocks;
};

// Epilogue: rows [m0, m0 + rows), columns [n0, n0 + cols) of out = acc * scale.
inline void store_tile(const Problem& p, const float* acc, int64_t ld, int64_t m0, int64_t rows,
                       int64_t n0, int64_t cols) {
  for (int64_t i = 0; i < rows; ++i) {
    const float* a = acc + i * ld;
    if (p.out_bf16) {
      uint16_t* o = static_cast<uint16_t*>(p.out) + (m0 + i) * p.N + n0;
      for (int64_t j = 0; j < cols; ++j) o[j] = f32_to_bf16(a[j] * p.scale[n0 + j]);
    } else {
      float* o = static_cast<float*>(p.out) + (m0 + i) * p.N + n0;
      for (int64_t j = 0; j < cols; ++j) o[j] = a[j] * p.scale[n0 + j];
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

// Direct path: acc[MR][NV*16] = x[0:MR, :] @ w[:, n0:n0 + NV*16] over all K, read from int8.
template <int MR, int NV, bool kMasked>
void direct_tile(const Problem& p, int64_t n0, float* acc_out) {
  const int64_t K = p.K, N = p.N;
  __m512 acc[MR][NV];
  __mmask16 masks[NV];
#pragma GCC unroll 16
  for (int v = 0; v < NV; ++v) masks[v] = lane_mask(N - n0 - 16 * v);
#pragma GCC unroll 16
  for (int m = 0; m < MR; ++m)
#pragma GCC unroll 16
    for (int v = 0; v < NV; ++v) acc[m][v] = _mm512_setzero_ps();
  const int8_t* w = p.w + n0;
  const float* x = p.x;
  constexpr int64_t kAhead = 16;  // rows prefetched ahead (rows are N bytes apart)
  for (int64_t k = 0; k < K; ++k) {
    const int8_t* row = w + k * N;
    if (k + kAhead < K) {
#pragma GCC unroll 4
      for (int v = 0; v < NV; v += 4) __builtin_prefetch(row + kAhead * N + 16 * v);
    }
    __m512 b[NV];
#pragma GCC unroll 16
    for (int v = 0; v < NV; ++v) b[v] = load_w16<kMasked>(row + 16 * v, masks[v]);
#pragma GCC unroll 16
    for (int m = 0; m < MR; ++m) {
      const __m512 a = _mm512_set1_ps(x[m * K + k]);
#pragma GCC unroll 16
      for (int v = 0; v < NV; ++v) acc[m][v] = _mm512_fmadd_ps(a, b[v], acc[m][v]);
    }
  }
#pragma GCC unroll 16
  for (int m = 0; m < MR; ++m)
#pragma GCC unroll 16
    for (int v = 0; v < NV; ++v) _mm512_storeu_ps(acc_out + m * NV * 16 + 16 * v, acc[m][v]);
}

// Widen w[k0:k0 + kc, n0:n0 + 64] into panel [kc][64] f32 (columns past N are 0).
inline void pack_panel(const Problem& p, int64_t k0, int64_t kc, int64_t n0, float* panel) {
  __mmask16 masks[4];
  for (int v = 0; v < 4; ++v) masks[v] = lane_mask(p.N - n0 - 16 * v);
  const bool full = n0 + kPanel <= p.N;
  for (int64_t k = 0; k < kc; ++k) {
    const int8_t* row = p.w + (k0 + k) * p.N + n0;
    float* dst = panel + k * kPanel;
    if (full) {
      for (int v = 0; v < 4; ++v) _mm512_store_ps(dst + 16 * v, load_w16<false>(row + 16 * v, 0));
    } else {
      for (int v = 0; v < 4; ++v) _mm512_store_ps(dst + 16 * v, load_w16<true>(row + 16 * v, masks[v]));
    }
  }
}

// Packed path: c[MR][64] (+)= a[0:MR, 0:kc] @ panel[0:kc][64]; a rows lda apart.
template <int MR>
void packed_tile(const float* a, int64_t lda, const float* panel, int64_t kc, float* c,
                 bool accumulate) {
  __m512 acc[MR][4];
#pragma GCC unroll 8
  for (int m = 0; m < MR; ++m)
#pragma GCC unroll 4
    for (int v = 0; v < 4; ++v)
      acc[m][v] = accumulate ? _mm512_loadu_ps(c + m * kPanel + 16 * v) : _mm512_setzero_ps();
  for (int64_t k = 0; k < kc; ++k) {
    const float* b = panel + k * kPanel;
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
    for (int v = 0; v < 4; ++v) _mm512_storeu_ps(c + m * kPanel + 16 * v, acc[m][v]);
}

template <int MR, int NV>
void direct_item(const Problem& p, int64_t item) {
  const int64_t n0 = item * NV * 16, cols = std::min<int64_t>(NV * 16, p.N - n0);
  alignas(64) float acc[MR * NV * 16];
  if (cols == NV * 16) direct_tile<MR, NV, false>(p, n0, acc);
  else direct_tile<MR, NV, true>(p, n0, acc);
  store_tile(p, acc, NV * 16, 0, MR, n0, cols);
}

template <int MR>
void direct_item_nv(const Problem& p, int64_t item) {
  switch (p.nv) {
    case 16: if constexpr (MR == 1) { direct_item<MR, 16>(p, item); break; } [[fallthrough]];
    case 8: if constexpr (MR <= 3) { direct_item<MR, 8>(p, item); break; } [[fallthrough]];
    case 4: direct_item<MR, 4>(p, item); break;
    case 2: direct_item<MR, 2>(p, item); break;
    default: direct_item<MR, 1>(p, item); break;
  }
}

void packed_item(const Problem& p, int64_t item) {
  struct Scratch {
    std::vector<float, std::allocator<float>> panel_storage, acc;
  };
  thread_local Scratch s;
  const int64_t mb = item % p.num_m_blocks, nb = item / p.num_m_blocks;
  const int64_t m0 = mb * p.m_block, rows = std::min(p.m_block, p.M - m0);
  const int64_t n0 = nb * kPanel, cols = std::min<int64_t>(kPanel, p.N - n0);
  s.panel_storage.resize(kPanelK * kPanel + 16);
  float* panel = reinterpret_cast<float*>((reinterpret_cast<uintptr_t>(s.panel_storage.data()) + 63) &
                                          ~static_cast<uintptr_t>(63));
  s.acc.resize(rows * kPanel);
  float* acc = s.acc.data();
  if (p.K == 0) std::fill(acc, acc + rows * kPanel, 0.0f);
  for (int64_t k0 = 0; k0 < p.K; k0 += kPanelK) {
    const int64_t kc = std::min(kPanelK, p.K - k0);
    pack_panel(p, k0, kc, n0, panel);
    const bool accumulate = k0 > 0;
    int64_t i = 0;
    for (; i + kPackedRows <= rows; i += kPackedRows)
      packed_tile<kPackedRows>(p.x + (m0 + i) * p.K + k0, p.K, panel, kc, acc + i * kPanel, accumulate);
    const float* a = p.x + (m0 + i) * p.K + k0;
    switch (rows - i) {
      case 5: packed_tile<5>(a, p.K, panel, kc, acc + i * kPanel, accumulate); break;
      case 4: packed_tile<4>(a, p.K, panel, kc, acc + i * kPanel, accumulate); break;
      case 3: packed_tile<3>(a, p.K, panel, kc, acc + i * kPanel, accumulate); break;
      case 2: packed_tile<2>(a, p.K, panel, kc, acc + i * kPanel, accumulate); break;
      case 1: packed_tile<1>(a, p.K, panel, kc, acc + i * kPanel, accumulate); break;
      default: break;
    }
  }
  store_tile(p, acc, kPanel, m0, rows, n0, cols);
}

void run_item(const Problem& p, int64_t item) {
  if (p.M > kDirectMaxRows) return packed_item(p, item);
  switch (p.M) {
    case 1: return direct_item_nv<1>(p, item);
    case 2: return direct_item_nv<2>(p, item);
    case 3: return direct_item_nv<3>(p, item);
    default: return direct_item_nv<4>(p, item);
  }
}

#else  // portable loops (auto-vectorised by the compiler for the host's vector width)

void run_item(const Problem& p, int64_t item) {
  const int64_t nc = p.nv * 16, n0 = item * nc, cols = std::min(nc, p.N - n0);
  std::vector<float> acc(nc);
  for (int64_t m = 0; m < p.M; ++m) {
    std::fill(acc.begin(), acc.end(), 0.0f);
    const float* x = p.x + m * p.K;
    for (int64_t k = 0; k < p.K; ++k) {
      const int8_t* row = p.w + k * p.N + n0;
      const float xv = x[k];
      for (int64_t j = 0; j < cols; ++j) acc[j] += xv * static_cast<float>(row[j]);
    }
    store_tile(p, acc.data(), nc, m, 1, n0, cols);
  }
}

#endif

struct Progress {  // shared with pool tasks, which may start after the call returned
  std::atomic<int64_t> next{0};
  std::atomic<int64_t> done{0};
};

void run(const Problem& p, int64_t items, ffi::ThreadPool& pool) {
  auto progress = std::make_shared<Progress>();
  // Pool tasks hold `progress` only; they touch the buffers just while holding an item, and
  // the call returns only when every item is done.
  auto work = [&p, items](Progress& pr) {
    for (int64_t i; (i = pr.next.fetch_add(1)) < items;) {
      run_item(p, i);
      pr.done.fetch_add(1);
    }
  };
  const int64_t helpers = std::min<int64_t>(pool.num_threads(), items - 1);
  for (int64_t i = 0; i < helpers; ++i) pool.Schedule([progress, work]() { work(*progress); });
  work(*progress);
  while (progress->done.load() < items) std::this_thread::yield();
}

// The column tile width (16-lane vectors) of the direct path for M rows: the widest that
// keeps the accumulators in registers and still gives every thread several items.
int64_t direct_width(int64_t M, int64_t N, int64_t workers) {
  const int64_t widest = M == 1 ? 16 : M <= 3 ? 8 : 4;
  const int64_t vectors = (N + 15) / 16;
  for (int64_t nv = widest; nv > 1; nv /= 2)
    if ((vectors + nv - 1) / nv >= 4 * workers) return nv;
  return 1;
}

ffi::Error Impl(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::Buffer<ffi::S8> w,
                ffi::Buffer<ffi::F32> scale, ffi::Buffer<ffi::S32> layer,
                ffi::Result<ffi::AnyBuffer> out) {
  const auto xd = x.dimensions(), wd = w.dimensions(), sd = scale.dimensions();
  if (xd.size() != 2 || (wd.size() != 2 && wd.size() != 3) || sd.size() + 1 != wd.size())
    return ffi::Error::InvalidArgument("expected x [M, K], w [K, N] or [L, K, N], scale [N] or [L, N]");
  const bool stacked = wd.size() == 3;
  const int64_t L = stacked ? wd[0] : 1, K = wd[stacked ? 1 : 0], N = wd[stacked ? 2 : 1];
  if (xd[1] != K || sd[sd.size() - 1] != N || (stacked && sd[0] != L) || layer.element_count() != 1)
    return ffi::Error::InvalidArgument("x, w and scale shapes disagree");
  const auto xt = x.element_type();
  if ((xt != ffi::F32 && xt != ffi::BF16) || out->element_type() != xt)
    return ffi::Error::InvalidArgument("x and out must be float32 or bfloat16, alike");
  const int64_t M = xd[0];
  if (M == 0 || N == 0) return ffi::Error::Success();
  // The layer as dynamic_index_in_dim takes it: negative counts from the end, then clamped.
  int64_t l = layer.typed_data()[0];
  if (l < 0) l += L;
  l = std::clamp<int64_t>(l, 0, L - 1);

  Problem p;
  p.M = M;
  p.K = K;
  p.N = N;
  p.w = w.typed_data() + l * K * N;
  p.scale = scale.typed_data() + l * N;
  p.out = out->untyped_data();
  p.out_bf16 = xt == ffi::BF16;
  thread_local std::vector<float> widened;
  if (xt == ffi::BF16) {
    widened.resize(M * K);
    const uint16_t* src = static_cast<const uint16_t*>(x.untyped_data());
    for (int64_t i = 0; i < M * K; ++i) widened[i] = bf16_to_f32(src[i]);
    p.x = widened.data();
  } else {
    p.x = static_cast<const float*>(x.untyped_data());
  }
  const int64_t workers = pool.num_threads() + 1;
  int64_t items;
#if defined(QMM_AVX512)
  if (M > kDirectMaxRows) {
    // m-blocks of about kMBlock rows, as even as whole 6-row tiles allow.
    const int64_t blocks = (M + kMBlock - 1) / kMBlock;
    const int64_t per = (M + blocks - 1) / blocks;
    p.m_block = (per + kPackedRows - 1) / kPackedRows * kPackedRows;
    p.num_m_blocks = (M + p.m_block - 1) / p.m_block;
    items = p.num_m_blocks * ((N + kPanel - 1) / kPanel);
  } else {
    p.nv = direct_width(M, N, workers);
    items = (N + p.nv * 16 - 1) / (p.nv * 16);
  }
#else
  p.nv = direct_width(1, N, workers);
  items = (N + p.nv * 16 - 1) / (p.nv * 16);
#endif
  run(p, items, pool);
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxserveQuantizedMatmulCpu, Impl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()          // x [M, K] f32 / bf16
                                  .Arg<ffi::Buffer<ffi::S8>>()    // w [K, N] or [L, K, N]
                                  .Arg<ffi::Buffer<ffi::F32>>()   // scale [N] or [L, N]
                                  .Arg<ffi::Buffer<ffi::S32>>()   // layer [] (0 when unstacked)
                                  .Ret<ffi::AnyBuffer>());        // out [M, N]
