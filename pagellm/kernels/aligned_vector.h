// Scratch vectors on cache-line (64-byte) boundaries, for buffers that AMX tiles or full-width
// vectors load and store.
#pragma once
#include <cstddef>
#include <new>
#include <vector>

namespace pagellm {

// Storage on 64-byte boundaries for scratch that tiles or full-width vectors read and write:
// malloc gives 16-byte alignment, and an AMX tile whose 64-byte rows straddle cache lines loads
// ~4x slower (a 2-core Xeon: 22 ns a product of 16 x 32 x 16 with its loads, 5.7 aligned).
template <typename T>
struct CacheLineAllocator {
  using value_type = T;
  CacheLineAllocator() = default;
  template <typename U>
  CacheLineAllocator(const CacheLineAllocator<U>&) {}
  T* allocate(size_t n) {
    return static_cast<T*>(::operator new(n * sizeof(T), std::align_val_t(64)));
  }
  void deallocate(T* p, size_t) { ::operator delete(p, std::align_val_t(64)); }
  template <typename U>
  bool operator==(const CacheLineAllocator<U>&) const {
    return true;
  }
  template <typename U>
  bool operator!=(const CacheLineAllocator<U>&) const {
    return false;
  }
};
template <typename T>
using AlignedVector = std::vector<T, CacheLineAllocator<T>>;

// The first n elements of a scratch vector that only grows. Resizing zero-fills every element it
// adds, so a thread_local buffer resized to each call's size was zero-filled again whenever a
// call needed more than the one before: a layer's 576- and 1536-wide inputs in turn, 30 times a
// step (the quantized tile kernels at 256 rows: 1.02-1.03x over 30 layers, ad-hoc).
template <typename V>
inline typename V::value_type* grown(V& v, size_t n) {
  if (v.size() < n) v.resize(n);
  return v.data();
}

}  // namespace pagellm
