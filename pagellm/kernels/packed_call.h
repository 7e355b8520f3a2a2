// Packed calls: a kernel's arguments as 64-bit words (integers and pointers as they are, a
// float as its bits in the low half, a double as its bits), so that a captured decode step runs
// its list of kernel calls from C in one call from Python (pagellm/kernels/packed.py) instead of
// one ctypes call each (about a microsecond of Python apiece, 270 calls a step).
//
// PAGELLM_PACKED(name) defines extern "C" int name_packed(const int64_t* words): name called
// with its arguments unpacked from words, in order.
#pragma once
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <utility>

namespace pagellm {

template <typename T>
inline T unpack_word(int64_t w) {
  if constexpr (std::is_pointer_v<T>) {
    return reinterpret_cast<T>(static_cast<intptr_t>(w));
  } else if constexpr (std::is_same_v<T, float>) {
    const uint32_t bits = static_cast<uint32_t>(w);
    float f;
    std::memcpy(&f, &bits, 4);
    return f;
  } else if constexpr (std::is_same_v<T, double>) {
    double d;
    std::memcpy(&d, &w, 8);
    return d;
  } else {
    static_assert(std::is_integral_v<T>, "a packed argument is an integer, pointer or float");
    return static_cast<T>(w);
  }
}

template <typename F>
struct PackedCall;

template <typename... A>
struct PackedCall<int (*)(A...)> {
  template <size_t... I>
  static int call(int (*fn)(A...), const int64_t* w, std::index_sequence<I...>) {
    return fn(unpack_word<A>(w[I])...);
  }
  static int run(int (*fn)(A...), const int64_t* w) {
    return call(fn, w, std::index_sequence_for<A...>{});
  }
};

}  // namespace pagellm

#define PAGELLM_PACKED(name)                                              \
  extern "C" int name##_packed(const int64_t* words) {                     \
    return ::pagellm::PackedCall<decltype(&name)>::run(&name, words);      \
  }
