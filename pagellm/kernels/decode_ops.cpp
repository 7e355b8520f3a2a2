// The element-wise glue of a decoder layer, fused for captured decode steps (see
// pagellm/runner/captured.py): what eager PyTorch runs as a dozen dispatched ops per layer
// (residual add, RMSNorm in float32, rotary, the K/V cache write, SiLU-and-multiply) as three
// calls. Each op rounds where the eager model rounds: in bf16 every intermediate that PyTorch
// stores as a bf16 tensor is rounded to bf16 here too (round to nearest even), so a captured
// step computes the values the eager one does up to float32 summation order.
// T is the activation type: float or bf16 (uint16_t bits). Built with -ffp-contract=off: a
// fused multiply-add would skip the rounding of a product that eager code rounds.
#include <algorithm>
#include <cmath>
#include <limits>
#include <cstdint>

#include "cpu_common.h"
#include "packed_call.h"

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

typedef int32_t vi __attribute__((vector_size(VW * 4)));

inline vf splat(float x) { return vf{} + x; }

// e^x, lane-wise, within ~1 ulp of the correctly rounded value (as the vectorized exp eager
// PyTorch uses): x = n ln2 + r with ln2 split in two so n ln2 is exact, e^r by Cephes's
// polynomial, times 2^n built in the exponent bits. Below the least normal result it returns
// 2^-126-ish (silu's 1 + e^-x is then 1 either way); above the float range it returns inf.
inline vf exp_v(vf x) {
  const vf hi = splat(88.3762626647949f), lo = splat(-87.3365478515625f);
  const vi overflow = x > hi;
  x = x > hi ? hi : x;
  x = x < lo ? lo : x;
  const vf t = x * splat(1.44269504088896341f) + splat(0.5f);
  vi n = __builtin_convertvector(t, vi);  // truncates toward zero: floor for t < 0 below
  n += __builtin_convertvector(n, vf) > t;  // a true lane is -1
  const vf fn = __builtin_convertvector(n, vf);
  x = x - fn * splat(0.693359375f);
  x = x - fn * splat(-2.12194440e-4f);
  const vf z = x * x;
  vf y = splat(1.9875691500e-4f);
  y = y * x + splat(1.3981999507e-3f);
  y = y * x + splat(8.3334519073e-3f);
  y = y * x + splat(4.1665795894e-2f);
  y = y * x + splat(1.6666665459e-1f);
  y = y * x + splat(5.0000001201e-1f);
  y = y * z + x + splat(1.f);
  const vi bits = (n + 127) << 23;
  vf scale;
  std::memcpy(&scale, &bits, sizeof scale);
  y = y * scale;
  return overflow ? splat(__builtin_inff()) : y;
}

// VW values of T as floats, and floats stored as T (bf16: rounded to nearest even, as store()).
typedef uint16_t vh __attribute__((vector_size(VW * 2)));
typedef uint32_t vu __attribute__((vector_size(VW * 4)));
inline vf load_t(const float* p) { return loadv(p); }
inline vf load_t(const uint16_t* p) {
  vh h;
  std::memcpy(&h, p, sizeof h);
  const vu bits = __builtin_convertvector(h, vu) << 16;
  vf v;
  std::memcpy(&v, &bits, sizeof v);
  return v;
}
inline void store_t(float* p, vf v) { storev(p, v); }
inline void store_t(uint16_t* p, vf v) {
  vu u;
  std::memcpy(&u, &v, sizeof u);
  u += 0x7FFFu + ((u >> 16) & 1u);
  const vh h = __builtin_convertvector(u >> 16, vh);
  std::memcpy(p, &h, sizeof h);
}
inline vf round_v(vf v, const float*) { return v; }
inline vf round_v(vf v, const uint16_t*) {
  vu u;
  std::memcpy(&u, &v, sizeof u);
  u = (u + 0x7FFFu + ((u >> 16) & 1u)) & 0xFFFF0000u;
  std::memcpy(&v, &u, sizeof v);
  return v;
}

// One row: residual (if any) += x, rounded; out = RMSNorm(that) * weight. float32: x * rsqrt(mean
// of squares + eps) * weight (F.rms_norm); bf16: normalized in float32, rounded, times the bf16
// weight, rounded (pagellm.layers.norm, as Hugging Face's LlamaRMSNorm). VW lanes at a time, the
// squares summed in four vector accumulators (a scalar float sum may not be reordered, and its
// chain of dependent adds made this the costliest glue op after SiLU: 256 rows, 60 calls per
// step); the hidden size's last hidden % VW values one at a time.
template <typename T>
void norm_row(const T* x, T* residual, const T* weight, T* out, int hidden, float eps) {
  const int whole = hidden - hidden % VW;
  vf acc[4] = {splat(0.f), splat(0.f), splat(0.f), splat(0.f)};
  float tail = 0.f;
  for (int i = 0; i < whole; i += VW) {
    vf v = load_t(x + i);
    if (residual != nullptr) {
      v = round_v(load_t(residual + i) + v, static_cast<const T*>(nullptr));
      store_t(residual + i, v);
    }
    acc[(i / VW) & 3] += v * v;
  }
  for (int i = whole; i < hidden; ++i) {
    float v = to_float(x[i]);
    if (residual != nullptr) {
      store(residual + i, to_float(residual[i]) + v);
      v = to_float(residual[i]);
    }
    tail += v * v;
  }
  const T* src = residual != nullptr ? residual : x;
  const vf total = (acc[0] + acc[1]) + (acc[2] + acc[3]);
  float sumsq = 0.f;
  for (int l = 0; l < VW; ++l) sumsq += total[l];
  sumsq += tail;
  const float inv = 1.f / std::sqrt(sumsq / static_cast<float>(hidden) + eps);
  const vf inv_v = splat(inv);
  for (int i = 0; i < whole; i += VW) {
    const vf normed = round_v(load_t(src + i) * inv_v, static_cast<const T*>(nullptr));
    store_t(out + i, normed * load_t(weight + i));
  }
  for (int i = whole; i < hidden; ++i) {
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

// 1 / (1 + e^-x): for fp32 with exp_v and a division (torch's bits within an ulp); for a bf16
// result, whose rounding keeps 8 bits, 2^(-x log2 e) from a degree-5 polynomial of x - floor(x)
// (vreduceps; vscalefps floors the exponent) and a reciprocal estimate with one Newton step
// (relative error ~1e-6 in all), where exp_v's range reduction and the division cost the most of
// a bf16 prefill's SiLU on AVX-512 (ad-hoc, 1024 rows x 1536 on the Xeon: 1.9x for the whole op).
inline vf sigmoid_v(vf x, const float*) { return splat(1.f) / (splat(1.f) + exp_v(-x)); }
inline vf sigmoid_v(vf x, const uint16_t*) {
#if defined(__AVX512DQ__)
  if constexpr (VW == 16) {
    __m512 t;
    std::memcpy(&t, &x, 64);
    t = _mm512_mul_ps(t, _mm512_set1_ps(-1.44269504088896341f));
    static constexpr float c[6] = {1.8775752e-3f, 8.9893425e-3f, 5.5826317e-2f,
                                   0.24015362f,   0.69315307f,   0.99999993f};
    const __m512 d = _mm512_add_ps(exp2_floor_poly(t, c), _mm512_set1_ps(1.f));
    __m512 r = _mm512_rcp14_ps(d);
    r = _mm512_mul_ps(r, _mm512_fnmadd_ps(d, r, _mm512_set1_ps(2.f)));  // r (2 - d r)
    // d = inf (x below ~-88): the estimate is 0 and the step inf * 0 = NaN; vmaxps gives its
    // second operand for a NaN: 0, as torch's 1 / (1 + inf)
    r = _mm512_max_ps(r, _mm512_setzero_ps());
    vf out;
    std::memcpy(&out, &r, 64);
    return out;
  }
#endif
  return sigmoid_v(x, static_cast<const float*>(nullptr));
}

// out[r] = silu(gate) * up over rows of fused [gate | up] (inter each): silu rounded to T, then
// the product (F.silu(gate) * up). VW lanes at a time; a tail narrower than VW goes through a
// zero-padded chunk.
template <typename T>
inline void silu_mul_chunk(const T* g, const T* u, T* dst) {
  const vf x = load_t(g);
  const vf act = round_v(x * sigmoid_v(x, static_cast<const T*>(nullptr)),
                         static_cast<const T*>(nullptr));
  store_t(dst, act * load_t(u));
}

template <typename T>
void silu_mul_row(const T* g, const T* u, T* dst, int inter) {
  int i = 0;
  for (; i + VW <= inter; i += VW) silu_mul_chunk<T>(g + i, u + i, dst + i);
  if (i == inter) return;
  T gt[VW] = {}, ut[VW] = {}, out[VW];
  for (int j = i; j < inter; ++j) gt[j - i] = g[j], ut[j - i] = u[j];
  silu_mul_chunk<T>(gt, ut, out);
  for (int j = i; j < inter; ++j) dst[j] = out[j - i];
}

template <typename T>
void silu_mul(const void* gate_up, void* out, int rows, int inter, int threads) {
  const T* in = static_cast<const T*>(gate_up);
  T* o = static_cast<T*>(out);
#pragma omp parallel for num_threads(threads) schedule(static) if (rows >= 4)
  for (int r = 0; r < rows; ++r) {
    const T* g = in + static_cast<int64_t>(r) * 2 * inter;
    silu_mul_row<T>(g, g + inter, o + static_cast<int64_t>(r) * inter, inter);
  }
}

// Index of the greatest value of one row, the first one among equals; a NaN counts as greater
// than any number (torch.argmax), so a row holding one takes the scalar path.
template <typename T>
int64_t argmax_row(const T* x, int n) {
  int i = 0;
  if (n >= VW) {
    vf best = load_t(x);
    vi at, lane;
    for (int j = 0; j < VW; ++j) lane[j] = j;
    at = lane;
    vi nan = best != best;
    for (i = VW; i + VW <= n; i += VW) {
      const vf v = load_t(x + i);
      const vi more = v > best;
      best = more ? v : best;
      at = more ? lane + i : at;
      nan |= v != v;
    }
    bool any_nan = false;
    for (int j = 0; j < VW; ++j) any_nan |= nan[j] != 0;
    if (!any_nan) {
      int64_t arg = at[0];
      float top = best[0];
      for (int j = 1; j < VW; ++j)
        if (best[j] > top || (best[j] == top && at[j] < arg)) top = best[j], arg = at[j];
      for (; i < n; ++i) {
        const float v = to_float(x[i]);
        if (v != v) break;  // a NaN in the tail: the scalar path below decides
        if (v > top) top = v, arg = i;
      }
      if (i == n) return arg;
    }
  }
  int64_t arg = 0;
  float top = to_float(x[0]);
  for (i = 1; i < n && top == top; ++i) {
    const float v = to_float(x[i]);
    if (v > top || v != v) top = v, arg = i;
  }
  return arg;
}

template <typename T>
void argmax_rows(const void* x, int rows, int n, int64_t stride, int64_t* out, int threads) {
  const T* xs = static_cast<const T*>(x);
#pragma omp parallel for num_threads(threads) schedule(static) if (rows >= 4)
  for (int r = 0; r < rows; ++r) out[r] = argmax_row<T>(xs + r * stride, n);
}

// Grammar bitmask: token t is allowed when bit t % 32 of word t / 32 is set (xgrammar's
// packing); every other logit becomes -inf, and tokens past the words too. Whole words of
// zeros or ones (most of a JSON grammar's mask) take one branch each.
void apply_bitmask_row(float* x, int n, const uint32_t* mask, int words) {
  const float ninf = -std::numeric_limits<float>::infinity();
  for (int w = 0; w < words && w * 32 < n; ++w) {
    const uint32_t bits = mask[w];
    const int base = w * 32, end = std::min(base + 32, n);
    if (bits == 0xffffffffu) continue;
    for (int t = base; t < end; ++t)
      if (!((bits >> (t - base)) & 1u)) x[t] = ninf;
  }
  for (int t = words * 32; t < n; ++t) x[t] = ninf;
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

extern "C" int decode_argmax_rows(int dtype_code, const void* x, int rows, int n, int64_t stride,
                                  int64_t* out, int threads) {
  if (n < 1) return 1;
  if (dtype_code == 0) argmax_rows<float>(x, rows, n, stride, out, threads);
  else if (dtype_code == 1) argmax_rows<uint16_t>(x, rows, n, stride, out, threads);
  else return 1;
  return 0;
}

// logits: float32 [n]; mask: int32 [words]. Returns 0, or 1 for bad sizes.
extern "C" int decode_apply_bitmask(float* logits, int n, const int32_t* mask, int words) {
  if (n < 1 || words < 0) return 1;
  apply_bitmask_row(logits, n, reinterpret_cast<const uint32_t*>(mask), words);
  return 0;
}

// Entries for a captured step's list of calls (packed_call.h).
PAGELLM_PACKED(decode_add_rms_norm)
PAGELLM_PACKED(decode_rope_kv_write)
PAGELLM_PACKED(decode_silu_mul)

// A captured step's calls in order: fns[i] a *_packed entry (of any kernel library), words[i] its
// arguments; stops at and returns the first non-zero status.
extern "C" int decode_run_calls(int n, void* const* fns, const int64_t* const* words) {
  for (int i = 0; i < n; ++i) {
    const int rc = reinterpret_cast<int (*)(const int64_t*)>(fns[i])(words[i]);
    if (rc != 0) return rc;
  }
  return 0;
}
