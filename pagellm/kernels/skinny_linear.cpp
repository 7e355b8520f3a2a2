// y = x W^T (+ bias) for a few rows of x: the decode steps' linear layers. With one to eight
// tokens a step streams every weight once and does little arithmetic with it, so the step is
// bounded by memory bandwidth; torch's CPU GEMM reads such a weight on one core (~9.5 GB/s on
// a Zen 2/3 EPYC, where two cores read ~19 GB/s). Here the output features are split over
// torch's OpenMP pool (the library links libgomp by its soname), each thread streaming its own
// rows of W once for all the tokens. fp32 accumulation; W and x are fp32 or bf16.
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

namespace {

#ifndef PAGELLM_VEC_WIDTH
#if defined(__AVX512F__)
#define PAGELLM_VEC_WIDTH 16
#else
#define PAGELLM_VEC_WIDTH 8
#endif
#endif

constexpr int VW = PAGELLM_VEC_WIDTH;
typedef float vf __attribute__((vector_size(VW * 4)));

inline vf loadv(const float* p) {
  vf v;
  std::memcpy(&v, p, sizeof v);
  return v;
}
inline vf loadv(const uint16_t* p) {  // bf16 -> fp32: the bits move up 16 places
  uint32_t bits[VW];
  for (int i = 0; i < VW; ++i) bits[i] = static_cast<uint32_t>(p[i]) << 16;
  vf v;
  std::memcpy(&v, bits, sizeof v);
  return v;
}
inline float to_float(float x) { return x; }
inline float to_float(uint16_t x) {
  uint32_t u = static_cast<uint32_t>(x) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
inline void store(float* dst, float x) { *dst = x; }
inline void store(uint16_t* dst, float x) {
  uint32_t u;
  std::memcpy(&u, &x, 4);
  u += 0x7FFFu + ((u >> 16) & 1u);  // round to nearest even
  *dst = static_cast<uint16_t>(u >> 16);
}
inline float hsum(vf v) {
  float s = 0.f;
  for (int i = 0; i < VW; ++i) s += v[i];
  return s;
}

// R rows of W against the M rows of x (fp32 copies in xf, row stride k): out[m][n + r].
template <typename T, int M, int R>
void rows_block(const T* w, const float* xf, int k, int n, float* acc_out) {
  vf acc[M][R] = {};
  const int kv = k - k % VW;
  for (int c = 0; c < kv; c += VW) {
    vf wv[R];
    for (int r = 0; r < R; ++r) wv[r] = loadv(w + static_cast<int64_t>(n + r) * k + c);
    for (int m = 0; m < M; ++m) {
      const vf xv = loadv(xf + static_cast<int64_t>(m) * k + c);
      for (int r = 0; r < R; ++r) acc[m][r] += wv[r] * xv;
    }
  }
  for (int m = 0; m < M; ++m) {
    for (int r = 0; r < R; ++r) {
      float s = hsum(acc[m][r]);
      for (int c = kv; c < k; ++c) {
        s += to_float(w[static_cast<int64_t>(n + r) * k + c]) * xf[static_cast<int64_t>(m) * k + c];
      }
      acc_out[m * R + r] = s;
    }
  }
}

template <typename T, int M>
void run_m(const T* x, const T* w, const T* bias, T* out, int n_out, int k, int num_threads) {
  constexpr int R = M <= 2 ? 4 : (M <= 4 ? 2 : 1);  // accumulators M * R stay in registers
  std::vector<float> xf(static_cast<size_t>(M) * k);
  for (int i = 0; i < M * k; ++i) xf[i] = to_float(x[i]);
  const int blocks = (n_out + R - 1) / R;
#pragma omp parallel for num_threads(num_threads) schedule(static)
  for (int b = 0; b < blocks; ++b) {
    const int n = b * R;
    float res[M * R];
    if (n + R <= n_out) {
      rows_block<T, M, R>(w, xf.data(), k, n, res);
    } else {  // the last rows one at a time
      for (int r = 0; n + r < n_out; ++r) {
        float one[M];
        rows_block<T, M, 1>(w, xf.data(), k, n + r, one);
        for (int m = 0; m < M; ++m) res[m * R + r] = one[m];
      }
    }
    for (int r = 0; r < R && n + r < n_out; ++r) {
      const float b0 = bias ? to_float(bias[n + r]) : 0.f;
      for (int m = 0; m < M; ++m) store(out + static_cast<int64_t>(m) * n_out + n + r, res[m * R + r] + b0);
    }
  }
}

template <typename T>
int run(const T* x, const T* w, const T* bias, T* out, int m, int n, int k, int threads) {
  switch (m) {
    case 1: run_m<T, 1>(x, w, bias, out, n, k, threads); return 0;
    case 2: run_m<T, 2>(x, w, bias, out, n, k, threads); return 0;
    case 3: run_m<T, 3>(x, w, bias, out, n, k, threads); return 0;
    case 4: run_m<T, 4>(x, w, bias, out, n, k, threads); return 0;
    case 5: run_m<T, 5>(x, w, bias, out, n, k, threads); return 0;
    case 6: run_m<T, 6>(x, w, bias, out, n, k, threads); return 0;
    case 7: run_m<T, 7>(x, w, bias, out, n, k, threads); return 0;
    case 8: run_m<T, 8>(x, w, bias, out, n, k, threads); return 0;
    default: return 3;
  }
}

}  // namespace

extern "C" int skinny_linear(int dtype_code,  // 0 = float32, 1 = bfloat16
                             const void* x, const void* w, const void* bias, void* out, int m,
                             int n, int k, int num_threads) {
  num_threads = std::max(1, num_threads);
  if (dtype_code == 0) {
    return run(static_cast<const float*>(x), static_cast<const float*>(w),
               static_cast<const float*>(bias), static_cast<float*>(out), m, n, k, num_threads);
  }
  if (dtype_code == 1) {
    return run(static_cast<const uint16_t*>(x), static_cast<const uint16_t*>(w),
               static_cast<const uint16_t*>(bias), static_cast<uint16_t*>(out), m, n, k,
               num_threads);
  }
  return 2;
}

extern "C" int skinny_linear_max_rows() { return 8; }
