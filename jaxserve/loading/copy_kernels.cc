// Tiled transposing and casting copies for the weight loader (called through ctypes, which
// releases the GIL, so loader threads run them in parallel).
//
// dtype codes: 0 = float32, 1 = bfloat16, 2 = float16. Every function copies a [rows, cols]
// source (row stride src_ld elements) into a destination with row stride dst_ld elements:
// `transpose_copy` writes dst[j, i] = src[i, j], `cast_copy` writes dst[i, j] = src[i, j].
// bfloat16 results are rounded to nearest even (NaN stays NaN).
#include <cstdint>
#include <cstring>
#include <type_traits>
#if defined(__SSE2__)
#include <emmintrin.h>
#endif

namespace {

inline float bf16_to_f32(uint16_t h) {
  uint32_t bits = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

inline uint16_t f32_to_bf16(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, 4);
  if ((bits & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((bits >> 16) | 0x40);  // quiet NaN
  bits += 0x7fffu + ((bits >> 16) & 1u);
  return static_cast<uint16_t>(bits >> 16);
}

inline float f16_to_f32(uint16_t h) {
  uint32_t sign = (h & 0x8000u) << 16, exp = (h >> 10) & 0x1fu, man = h & 0x3ffu, bits;
  if (exp == 0x1f) {
    bits = sign | 0x7f800000u | (man << 13);
  } else if (exp != 0) {
    bits = sign | ((exp + 112u) << 23) | (man << 13);
  } else if (man == 0) {
    bits = sign;
  } else {  // subnormal: normalise
    int e = -1;
    do { man <<= 1; ++e; } while (!(man & 0x400u));
    bits = sign | ((112u - e) << 23) | ((man & 0x3ffu) << 13);
  }
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

struct F32 { using T = float; static float load(T x) { return x; } static T store(float x) { return x; } };
struct BF16 { using T = uint16_t; static float load(T x) { return bf16_to_f32(x); } static T store(float x) { return f32_to_bf16(x); } };
struct F16 { using T = uint16_t; static float load(T x) { return f16_to_f32(x); } };

constexpr int64_t kTile = 64;

// One tile at a time: its rows are first copied (converted) into a small contiguous buffer
// (reading the source's rows in order), then written out column by column. Reading a tile's
// column straight from the source would touch rows a power-of-two stride apart, which share
// a cache set and evict each other.
template <typename S, typename D>
void transpose_tiles(const void* src_v, int64_t rows, int64_t cols, int64_t src_ld, void* dst_v, int64_t dst_ld) {
  auto* src = static_cast<const typename S::T*>(src_v);
  auto* dst = static_cast<typename D::T*>(dst_v);
  typename D::T tile[kTile][kTile];
  for (int64_t i0 = 0; i0 < rows; i0 += kTile) {
    const int64_t ni = i0 + kTile < rows ? kTile : rows - i0;
    for (int64_t j0 = 0; j0 < cols; j0 += kTile) {
      const int64_t nj = j0 + kTile < cols ? kTile : cols - j0;
      for (int64_t i = 0; i < ni; ++i) {
        const typename S::T* in = src + (i0 + i) * src_ld + j0;
        for (int64_t j = 0; j < nj; ++j) tile[i][j] = D::store(S::load(in[j]));
      }
      for (int64_t j = 0; j < nj; ++j) {
        typename D::T* out = dst + (j0 + j) * dst_ld + i0;
        for (int64_t i = 0; i < ni; ++i) out[i] = tile[i][j];
      }
    }
  }
}

// 16-bit to the same 16-bit type: the bits move unchanged.
struct U16 { using T = uint16_t; static T load(T x) { return x; } static T store(T x) { return x; } };

#if defined(__SSE2__)
// Transposes the 8 x 8 block of 16-bit values at `src` (row stride src_ld) into 8 vectors,
// out[k] holding column k.
inline void transpose8x8(const uint16_t* src, int64_t src_ld, __m128i out[8]) {
  __m128i r[8], a[8], b[8];
  for (int k = 0; k < 8; ++k) r[k] = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + k * src_ld));
  for (int k = 0; k < 4; ++k) {
    a[2 * k] = _mm_unpacklo_epi16(r[2 * k], r[2 * k + 1]);
    a[2 * k + 1] = _mm_unpackhi_epi16(r[2 * k], r[2 * k + 1]);
  }
  for (int h = 0; h < 2; ++h) {  // rows 0-3, then 4-7
    const int o = 4 * h;
    b[o + 0] = _mm_unpacklo_epi32(a[o + 0], a[o + 2]);
    b[o + 1] = _mm_unpackhi_epi32(a[o + 0], a[o + 2]);
    b[o + 2] = _mm_unpacklo_epi32(a[o + 1], a[o + 3]);
    b[o + 3] = _mm_unpackhi_epi32(a[o + 1], a[o + 3]);
  }
  for (int k = 0; k < 4; ++k) {
    out[2 * k] = _mm_unpacklo_epi64(b[k], b[k + 4]);
    out[2 * k + 1] = _mm_unpackhi_epi64(b[k], b[k + 4]);
  }
}

// 16-bit transposes in 8 x 8 register blocks; with `widen`, bfloat16 to float32 on the way
// (a bfloat16 is the top half of its float32). Edges go through the scalar tiles.
template <bool widen>
void transpose_16bit_simd(const void* src_v, int64_t rows, int64_t cols, int64_t src_ld, void* dst_v, int64_t dst_ld) {
  auto* src = static_cast<const uint16_t*>(src_v);
  const int64_t rows8 = rows & ~int64_t{7}, cols8 = cols & ~int64_t{7};
  const __m128i zero = _mm_setzero_si128();
  __m128i col[8];
  for (int64_t i0 = 0; i0 < rows8; i0 += kTile) {
    const int64_t i1 = i0 + kTile < rows8 ? i0 + kTile : rows8;
    for (int64_t j0 = 0; j0 < cols8; j0 += kTile) {
      const int64_t j1 = j0 + kTile < cols8 ? j0 + kTile : cols8;
      for (int64_t i = i0; i < i1; i += 8) {
        for (int64_t j = j0; j < j1; j += 8) {
          transpose8x8(src + i * src_ld + j, src_ld, col);
          for (int k = 0; k < 8; ++k) {
            if (widen) {
              auto* out = static_cast<float*>(dst_v) + (j + k) * dst_ld + i;
              _mm_storeu_si128(reinterpret_cast<__m128i*>(out), _mm_unpacklo_epi16(zero, col[k]));
              _mm_storeu_si128(reinterpret_cast<__m128i*>(out + 4), _mm_unpackhi_epi16(zero, col[k]));
            } else {
              auto* out = static_cast<uint16_t*>(dst_v) + (j + k) * dst_ld + i;
              _mm_storeu_si128(reinterpret_cast<__m128i*>(out), col[k]);
            }
          }
        }
      }
    }
  }
  using D = typename std::conditional<widen, F32, U16>::type;
  using S = typename std::conditional<widen, BF16, U16>::type;
  using DT = typename D::T;
  DT* dst = static_cast<DT*>(dst_v);
  if (cols8 < cols)  // the last columns, every row
    transpose_tiles<S, D>(src + cols8, rows, cols - cols8, src_ld, dst + cols8 * dst_ld, dst_ld);
  if (rows8 < rows)  // the last rows, the columns done above
    transpose_tiles<S, D>(src + rows8 * src_ld, rows - rows8, cols8, src_ld, dst + rows8, dst_ld);
}
#endif

template <typename S, typename D>
void cast_rows(const void* src_v, int64_t rows, int64_t cols, int64_t src_ld, void* dst_v, int64_t dst_ld) {
  auto* src = static_cast<const typename S::T*>(src_v);
  auto* dst = static_cast<typename D::T*>(dst_v);
  for (int64_t i = 0; i < rows; ++i)
    for (int64_t j = 0; j < cols; ++j) dst[i * dst_ld + j] = D::store(S::load(src[i * src_ld + j]));
}

using Kernel = void (*)(const void*, int64_t, int64_t, int64_t, void*, int64_t);

Kernel pick(int src, int dst, bool transpose) {
#if defined(__SSE2__)
  if (transpose && src == 1 && dst == 1) return transpose_16bit_simd<false>;
  if (transpose && src == 1 && dst == 0) return transpose_16bit_simd<true>;
#endif
  if (transpose && src == 1 && dst == 1) return transpose_tiles<U16, U16>;
  if (dst == 0) {
    if (src == 0) return transpose ? transpose_tiles<F32, F32> : cast_rows<F32, F32>;
    if (src == 1) return transpose ? transpose_tiles<BF16, F32> : cast_rows<BF16, F32>;
    if (src == 2) return transpose ? transpose_tiles<F16, F32> : cast_rows<F16, F32>;
  } else if (dst == 1) {
    if (src == 0) return transpose ? transpose_tiles<F32, BF16> : cast_rows<F32, BF16>;
    if (src == 1) return transpose ? transpose_tiles<U16, U16> : cast_rows<U16, U16>;
    if (src == 2) return transpose ? transpose_tiles<F16, BF16> : cast_rows<F16, BF16>;
  }
  return nullptr;
}

}  // namespace

extern "C" {

// 0 on success, -1 for a dtype pair without a kernel.
int jaxserve_transpose_copy(const void* src, int src_dtype, int64_t rows, int64_t cols, int64_t src_ld, void* dst,
                            int dst_dtype, int64_t dst_ld) {
  Kernel k = pick(src_dtype, dst_dtype, true);
  if (k == nullptr) return -1;
  k(src, rows, cols, src_ld, dst, dst_ld);
  return 0;
}

int jaxserve_cast_copy(const void* src, int src_dtype, int64_t rows, int64_t cols, int64_t src_ld, void* dst,
                       int dst_dtype, int64_t dst_ld) {
  Kernel k = pick(src_dtype, dst_dtype, false);
  if (k == nullptr) return -1;
  k(src, rows, cols, src_ld, dst, dst_ld);
  return 0;
}
}

// GGUF block formats, dequantized to float32 (ggml's layouts; codes are ggml's type ids).
// Each block holds 32 values: an f16 scale d (and an f16 minimum m for the _1 formats), for
// the 5-bit formats 32 high bits qh, then the low bits: byte j holds value j in its low
// nibble and value j + 16 in its high nibble (Q8_0: one int8 per value).
namespace {

inline float half_at(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  return f16_to_f32(h);
}

template <int kType>
void dequantize_blocks(const uint8_t* src, int64_t n_blocks, float* out) {
  for (int64_t b = 0; b < n_blocks; ++b, out += 32) {
    if (kType == 8) {  // Q8_0: d, int8[32]
      const float d = half_at(src);
      const auto* q = reinterpret_cast<const int8_t*>(src + 2);
      for (int j = 0; j < 32; ++j) out[j] = d * q[j];
      src += 34;
      continue;
    }
    const bool has_min = kType == 3 || kType == 7;
    const bool five_bit = kType == 6 || kType == 7;
    const float d = half_at(src);
    const float m = has_min ? half_at(src + 2) : 0.0f;
    const uint8_t* p = src + (has_min ? 4 : 2);
    uint32_t qh = 0;
    if (five_bit) {
      std::memcpy(&qh, p, 4);
      p += 4;
    }
    const int offset = has_min ? 0 : (five_bit ? 16 : 8);
    for (int j = 0; j < 16; ++j) {
      int lo = p[j] & 0x0F, hi = p[j] >> 4;
      if (five_bit) {
        lo |= ((qh >> j) << 4) & 0x10;
        hi |= (qh >> (j + 12)) & 0x10;
      }
      out[j] = (lo - offset) * d + m;
      out[j + 16] = (hi - offset) * d + m;
    }
    src = p + 16;
  }
}

}  // namespace

extern "C" {

// 0 on success, -1 for a type without a kernel (Q4_0 = 2, Q4_1 = 3, Q5_0 = 6, Q5_1 = 7, Q8_0 = 8).
int jaxserve_dequantize_gguf(int type, const void* blocks, int64_t n_blocks, float* out) {
  const auto* src = static_cast<const uint8_t*>(blocks);
  switch (type) {
    case 2: dequantize_blocks<2>(src, n_blocks, out); return 0;
    case 3: dequantize_blocks<3>(src, n_blocks, out); return 0;
    case 6: dequantize_blocks<6>(src, n_blocks, out); return 0;
    case 7: dequantize_blocks<7>(src, n_blocks, out); return 0;
    case 8: dequantize_blocks<8>(src, n_blocks, out); return 0;
    default: return -1;
  }
}
}
