// The element-wise glue of a decoder layer, fused for captured decode steps (see
// pagellm/runner/captured.py): what eager PyTorch runs as a dozen dispatched ops per layer
// (residual add, RMSNorm in float32, rotary, the K/V cache write, SiLU-and-multiply) as three
// calls. Each op rounds where the eager model rounds: in bf16 every intermediate that PyTorch
// stores as a bf16 tensor is rounded to bf16 here too (round to nearest even), so a captured
// step computes the values the eager one does up to float32 summation order.
// T is the activation type: float or bf16 (uint16_t bits). Built with -ffp-contract=off: a
// fused multiply-add would skip the rounding of a product that eager code rounds.
#include <cmath>
#include <cstdint>

#include "cpu_common.h"

namespace {

using namespace pagellm;

// x rounded to T's precision (float: as it is).
inline float as_t(float x, const float*) { return x; }
inline float as_t(float x, const uint16_t*) {
  uint16_t b;
  store(&b, x);
  return to_float(b);
}

template <typename T>
inline float round_to(float x) {
  return as_t(x, static_cast<const T*>(nullptr));
}

// One row: residual (if any) += x, rounded; out = RMSNorm(that) * weight. float32: x * rsqrt(mean
// of squares + eps) * weight (F.rms_norm); bf16: normalized in float32, rounded, times the bf16
// weight, rounded (pagellm.layers.norm, as Hugging Face's LlamaRMSNorm).
template <typename T>
void norm_row(const T* x, T* residual, const T* weight, T* out, int hidden, float eps) {
  const T* src = x;
  if (residual != nullptr) {
    for (int i = 0; i < hidden; ++i) store(residual + i, to_float(residual[i]) + to_float(x[i]));
    src = residual;
  }
  float sumsq = 0.f;
  for (int i = 0; i < hidden; ++i) {
    const float v = to_float(src[i]);
    sumsq += v * v;
  }
  const float inv = 1.f / std::sqrt(sumsq / static_cast<float>(hidden) + eps);
  for (int i = 0; i < hidden; ++i) {
    const float normed = round_to<T>(to_float(src[i]) * inv);
    store(out + i, normed * to_float(weight[i]));
  }
}

template <typename T>
void add_rms_norm(const void* x, void* residual, const void* weight, void* out, int rows,
                  int hidden, float eps, int threads) {
  const T* xs = static_cast<const T*>(x);
  T* rs = static_cast<T*>(residual);
  T* os = static_cast<T*>(out);
#pragma omp parallel for num_threads(threads) schedule(static) if (rows >= 16)
  for (int r = 0; r < rows; ++r) {
    const int64_t off = static_cast<int64_t>(r) * hidden;
    norm_row<T>(xs + off, rs ? rs + off : nullptr, static_cast<const T*>(weight), os + off,
                hidden, eps);
  }
}

// Rotate one head (rotate-half layout) at the position whose cos/sin rows are c and s:
// first half x1 c - x2 s, second half x2 c + x1 s, every product and sum rounded to T.
template <typename T>
inline void rotate(const T* src, T* dst, const float* c, const float* s, int half) {
  for (int i = 0; i < half; ++i) {
    const float cb = round_to<T>(c[i]), sb = round_to<T>(s[i]);
    const float x1 = to_float(src[i]), x2 = to_float(src[i + half]);
    const float a = round_to<T>(x1 * cb), b = round_to<T>(x2 * sb);
    const float e = round_to<T>(x2 * cb), f = round_to<T>(x1 * sb);
    store(dst + i, a - b);
    store(dst + i + half, e + f);
  }
}

// Rows of fused [q heads | k heads | v heads] projections: q rotated into q_out [rows, hq, d],
// k rotated and v copied into the cache slot of each row ([hkv, cache_rows, d] per tensor;
// a negative slot writes nothing).
template <typename T>
void rope_kv_write(const void* qkv, const int64_t* positions, const float* cos, const float* sin,
                   void* q_out, void* k_cache, void* v_cache, const int64_t* slots, int rows,
                   int hq, int hkv, int d, int64_t cache_rows, int threads) {
  const int half = d / 2;
  const int64_t stride = static_cast<int64_t>(hq + 2 * hkv) * d;
  const T* in = static_cast<const T*>(qkv);
  T* q = static_cast<T*>(q_out);
  T* kc = static_cast<T*>(k_cache);
  T* vc = static_cast<T*>(v_cache);
#pragma omp parallel for num_threads(threads) schedule(static) if (rows >= 16)
  for (int r = 0; r < rows; ++r) {
    const T* row = in + r * stride;
    const float* c = cos + positions[r] * half;
    const float* s = sin + positions[r] * half;
    for (int h = 0; h < hq; ++h)
      rotate<T>(row + h * d, q + (static_cast<int64_t>(r) * hq + h) * d, c, s, half);
    const int64_t slot = slots[r];
    if (slot < 0) continue;
    for (int h = 0; h < hkv; ++h) {
      const int64_t at = (h * cache_rows + slot) * d;
      rotate<T>(row + (hq + h) * d, kc + at, c, s, half);
      const T* v = row + (hq + hkv + h) * d;
      for (int i = 0; i < d; ++i) vc[at + i] = v[i];
    }
  }
}

// out[r] = silu(gate) * up over rows of fused [gate | up] (inter each): silu rounded to T, then
// the product (F.silu(gate) * up).
template <typename T>
void silu_mul(const void* gate_up, void* out, int rows, int inter, int threads) {
  const T* in = static_cast<const T*>(gate_up);
  T* o = static_cast<T*>(out);
#pragma omp parallel for num_threads(threads) schedule(static) if (rows >= 16)
  for (int r = 0; r < rows; ++r) {
    const T* g = in + static_cast<int64_t>(r) * 2 * inter;
    const T* u = g + inter;
    T* dst = o + static_cast<int64_t>(r) * inter;
    for (int i = 0; i < inter; ++i) {
      const float x = to_float(g[i]);
      const float act = round_to<T>(x / (1.f + std::exp(-x)));
      store(dst + i, act * to_float(u[i]));
    }
  }
}

}  // namespace

// dtype_code: 0 = float32, 1 = bfloat16. Each returns 0, or 1 for an unknown dtype code.
extern "C" int decode_add_rms_norm(int dtype_code, const void* x, void* residual,
                                   const void* weight, void* out, int rows, int hidden, float eps,
                                   int threads) {
  if (dtype_code == 0) add_rms_norm<float>(x, residual, weight, out, rows, hidden, eps, threads);
  else if (dtype_code == 1)
    add_rms_norm<uint16_t>(x, residual, weight, out, rows, hidden, eps, threads);
  else return 1;
  return 0;
}

extern "C" int decode_rope_kv_write(int dtype_code, const void* qkv, const int64_t* positions,
                                    const float* cos, const float* sin, void* q_out,
                                    void* k_cache, void* v_cache, const int64_t* slots, int rows,
                                    int hq, int hkv, int d, int64_t cache_rows, int threads) {
  if (dtype_code == 0)
    rope_kv_write<float>(qkv, positions, cos, sin, q_out, k_cache, v_cache, slots, rows, hq, hkv,
                         d, cache_rows, threads);
  else if (dtype_code == 1)
    rope_kv_write<uint16_t>(qkv, positions, cos, sin, q_out, k_cache, v_cache, slots, rows, hq,
                            hkv, d, cache_rows, threads);
  else return 1;
  return 0;
}

extern "C" int decode_silu_mul(int dtype_code, const void* gate_up, void* out, int rows,
                               int inter, int threads) {
  if (dtype_code == 0) silu_mul<float>(gate_up, out, rows, inter, threads);
  else if (dtype_code == 1) silu_mul<uint16_t>(gate_up, out, rows, inter, threads);
  else return 1;
  return 0;
}
