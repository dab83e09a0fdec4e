// KV-cache row writes for XLA:CPU, as an XLA FFI custom call with the pages aliased in place.
//
//   k_pages[slot[t]] = k_new[t], v_pages[slot[t]] = v_new[t]   for t in [0, T)
//
// The pages are viewed as rows of the slot axis ([P * S, row] for pages [P, S, ...]); a row is
// copied as bytes, so any page dtype works. XLA:CPU has no bf16 scatter: it upcasts one,
// converting the whole pool to f32 and back around every layer's write (SmolLM2's default
// bf16 pool: 170 ms of a 180 ms decode step). Slots outside [0, P * S) are skipped (the
// reference promises in-bounds slots; padding tokens point at the null page).

#include <cstdint>
#include <cstring>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

ffi::Error Impl(ffi::AnyBuffer k_new, ffi::AnyBuffer v_new, ffi::AnyBuffer k_in, ffi::AnyBuffer v_in,
                ffi::Buffer<ffi::S32> slots, ffi::Result<ffi::AnyBuffer> k_out, ffi::Result<ffi::AnyBuffer> v_out) {
  const int64_t T = slots.element_count();
  for (auto [fresh, in, out] : {std::tuple{&k_new, &k_in, &k_out}, std::tuple{&v_new, &v_in, &v_out}}) {
    if (fresh->element_type() != in->element_type() || (*out)->element_type() != in->element_type())
      return ffi::Error::InvalidArgument("new rows and pages must have one dtype");
    const auto pd = in->dimensions();
    if (pd.size() < 2) return ffi::Error::InvalidArgument("pages must be [P, S, ...]");
    const int64_t num_slots = pd[0] * pd[1];
    if (num_slots == 0) continue;
    const size_t row_bytes = in->size_bytes() / num_slots;
    if (T == 0 || fresh->size_bytes() != T * row_bytes)
      return ffi::Error::InvalidArgument("new rows must be [T, row] with a page row's size");
    char* dst = static_cast<char*>((*out)->untyped_data());
    if (dst != in->untyped_data()) std::memcpy(dst, in->untyped_data(), in->size_bytes());  // not aliased
    const char* src = static_cast<const char*>(fresh->untyped_data());
    const int32_t* s = slots.typed_data();
    for (int64_t t = 0; t < T; ++t)
      if (s[t] >= 0 && s[t] < num_slots) std::memcpy(dst + s[t] * row_bytes, src + t * row_bytes, row_bytes);
  }
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxserveKvWriteCpu, Impl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::AnyBuffer>()          // k_new [T, ...]
                                  .Arg<ffi::AnyBuffer>()          // v_new [T, ...]
                                  .Arg<ffi::AnyBuffer>()          // k_pages [P, S, ...] (aliased to k_out)
                                  .Arg<ffi::AnyBuffer>()          // v_pages (aliased to v_out)
                                  .Arg<ffi::Buffer<ffi::S32>>()   // slot_mapping [T]
                                  .Ret<ffi::AnyBuffer>()          // k_pages, rows written
                                  .Ret<ffi::AnyBuffer>());        // v_pages

extern "C" const char* JaxserveKvWriteCpuIsa() { return "memcpy"; }
