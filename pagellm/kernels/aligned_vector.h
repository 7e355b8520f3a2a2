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

}  // namespace pagellm
