// Paged decode attention for the CPU: one query token per sequence, reading K/V straight from
// the block-paged cache (no gathered copy). Layout of each cache: [kv_heads, blocks, block, dim].
// Work is split over (sequence, kv head) pairs on torch's OpenMP pool; each pair handles the
// `group` query heads that share its KV head. Scores and accumulation are float32.
// Templates take T, the type of q and out (float or bf16), and C, the cache's element type: T,
// or FP8 (E4M3 / E5M2 bytes). An FP8 cache holds K / k_scale and V / v_scale: k_scale is folded
// into `scale` by the caller, v_scale multiplies the output.
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "aligned_vector.h"
#include "cpu_common.h"
#include "packed_call.h"
#include <algorithm>
#include <utility>
#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#include <immintrin.h>
#endif

namespace {

using namespace pagellm;

struct Args {
  const void* q;
  const void* k_cache;
  const void* v_cache;
  const int32_t* block_tables;
  const int32_t* context_lens;
  void* out;
  int batch, num_heads, num_kv_heads, head_dim, num_blocks, block_size, max_blocks;
  float scale;
  float v_scale;
};

// Keys [lo, hi) of one (sequence, kv head) pair: per query head of the group, the output not yet
// divided by its softmax sum (part[g * d ...]), then the max (part[group * d + g]) and the sum
// (part[group * d + group + g]) of its scores.
using PartFn = void (*)(const Args&, int, int, int, int, std::vector<float>&, float*);

// Locality 3 fetches into L1, 1 into L2 only: the AVX-512 kernel's prefetches then do not wait
// on L1's few fill buffers (30 layers of SmolLM2's heads from DRAM, 2-core Xeon, against L1:
// 1.01-1.08x at 32-256 sequences of 90-650 keys, 1.00-1.09x at 1-2 sequences of 600-8000).
template <int Locality = 3>
inline void prefetch_block(const void* p, int64_t bytes) {
  const char* c = static_cast<const char*>(p);
  for (int64_t off = 0; off < bytes; off += 64) __builtin_prefetch(c + off, 0, Locality);
}

#if defined(__AVX512F__)
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const uint16_t* p) {
  __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}
// FP8 -> fp16 bits -> fp32. E5M2 is the upper byte of an fp16. E4M3's exponent and mantissa moved
// up 7 places read as an fp16 of 2^-8 times the value, subnormals included: one multiply fixes it.
inline __m512 load16(const fp8_e5m2* p) {
  const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm512_cvtph_ps(_mm256_slli_epi16(_mm256_cvtepu8_epi16(raw), 8));
}
inline __m512 load16(const fp8_e4m3* p) {
  const __m256i h = e4m3_half_bits16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm512_mul_ps(_mm512_cvtph_ps(h), _mm512_set1_ps(256.f));
}

// e^x for x <= 0 (softmax inputs after subtracting the max): 2^(x log2 e) split into 2^n * 2^f,
// with 2^f from its degree-7 Taylor series on |f| <= 0.5 (relative error ~5e-9).
inline __m512 exp512(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-100.f));
  const __m512 t = _mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f));
  const __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_mul_ps(_mm512_sub_ps(t, n), _mm512_set1_ps(0.6931471805599453f));
  __m512 p = _mm512_set1_ps(1.f / 5040.f);
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f / 720.f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f / 120.f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f / 24.f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f / 6.f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f));
  return _mm512_scalef_ps(p, n);
}

// [sum(a), sum(b), sum(c), sum(d)] with one shared shuffle tree instead of four reductions.
inline __m128 hsum4(__m512 a, __m512 b, __m512 c, __m512 d) {
  const __m512 ab = _mm512_add_ps(_mm512_unpacklo_ps(a, b), _mm512_unpackhi_ps(a, b));
  const __m512 cd = _mm512_add_ps(_mm512_unpacklo_ps(c, d), _mm512_unpackhi_ps(c, d));
  const __m512 lanes = _mm512_add_ps(_mm512_shuffle_ps(ab, cd, _MM_SHUFFLE(1, 0, 1, 0)),
                                     _mm512_shuffle_ps(ab, cd, _MM_SHUFFLE(3, 2, 3, 2)));
  return _mm_add_ps(
      _mm_add_ps(_mm512_extractf32x4_ps(lanes, 0), _mm512_extractf32x4_ps(lanes, 1)),
      _mm_add_ps(_mm512_extractf32x4_ps(lanes, 2), _mm512_extractf32x4_ps(lanes, 3)));
}

inline __mmask16 tail_mask(int remaining) {
  return remaining >= 16 ? static_cast<__mmask16>(0xFFFF)
                         : static_cast<__mmask16>((1u << remaining) - 1u);
}

// Exponentials of s[0..n) after subtracting their max, in place; returns (max, sum).
std::pair<float, float> exp_avx512(float* s, int n) {
  __m512 vmax = _mm512_set1_ps(-3.0e38f);
  for (int j = 0; j < n; j += 16) {
    vmax = _mm512_max_ps(vmax, _mm512_mask_loadu_ps(vmax, tail_mask(n - j), s + j));
  }
  const float m = _mm512_reduce_max_ps(vmax);
  const __m512 mx = _mm512_set1_ps(m);
  __m512 vsum = _mm512_setzero_ps();
  for (int j = 0; j < n; j += 16) {
    const __mmask16 k = tail_mask(n - j);
    const __m512 e = exp512(_mm512_sub_ps(_mm512_maskz_loadu_ps(k, s + j), mx));
    _mm512_mask_storeu_ps(s + j, k, e);
    vsum = _mm512_add_ps(vsum, _mm512_maskz_mov_ps(k, e));
  }
  return {m, _mm512_reduce_add_ps(vsum)};
}

void softmax_avx512(float* s, int n) {
  const __m512 inv = _mm512_set1_ps(1.f / exp_avx512(s, n).second);
  for (int j = 0; j < n; j += 16) {
    const __mmask16 m = tail_mask(n - j);
    _mm512_mask_storeu_ps(s + j, m, _mm512_mul_ps(_mm512_maskz_loadu_ps(m, s + j), inv));
  }
}

// Vectorized keys [lo, hi) of a pair (lo a multiple of the block size): head_dim = 16 * W
// (W <= 8), group <= 16. q rows and the output accumulators live in registers/L1; every K and V
// row is read exactly once. W = head_dim / 16 and G = the group size are compile-time so that
// the loops over them unroll and the query rows and accumulators stay in registers. With `part`
// null, [lo, hi) is the whole context and the output is written; else `part` gets the PartFn
// layout.
template <typename T, typename C, int W, int G>
void attend_part_avx512(const Args& a, int b, int kvh, int lo, int hi,
                        std::vector<float>& scores, float* part) {
  constexpr int group = G;
  constexpr int w = W;
  const int d = a.head_dim;
  const int ctx = hi - lo;
  const T* q = static_cast<const T*>(a.q) + (static_cast<int64_t>(b) * a.num_heads + kvh * group) * d;
  const C* kc = static_cast<const C*>(a.k_cache);
  const C* vc = static_cast<const C*>(a.v_cache);
  const int32_t* table = a.block_tables + static_cast<int64_t>(b) * a.max_blocks + lo / a.block_size;
  const int64_t head_base = static_cast<int64_t>(kvh) * a.num_blocks * a.block_size;
  __m512 qv[G * W];
  const __m512 scale = _mm512_set1_ps(a.scale);
  for (int g = 0; g < group; ++g)
    for (int x = 0; x < w; ++x) qv[g * w + x] = _mm512_mul_ps(load16(q + g * d + x * 16), scale);
  grown(scores, static_cast<size_t>(group) * ctx);  // every score is written before it is read
  const int64_t block_bytes = static_cast<int64_t>(a.block_size) * d * sizeof(C);
  const int num_ctx_blocks = (ctx + a.block_size - 1) / a.block_size;
  // The first two blocks of K and of V: V's come in while K is walked (1.02-1.06x at 128-256
  // sequences of 90-400 keys whose blocks lie in order, as a fresh cache gives them; the same
  // on random blocks; 30 layers of SmolLM2's heads, 2-core Xeon, ad-hoc, in turn).
  for (int blk = 0; blk < std::min(2, num_ctx_blocks); ++blk) {
    prefetch_block<1>(kc + (head_base + static_cast<int64_t>(table[blk]) * a.block_size) * d,
                   block_bytes);
    prefetch_block<1>(vc + (head_base + static_cast<int64_t>(table[blk]) * a.block_size) * d,
                   block_bytes);
  }
  // Walk the context block by block (no integer division per row); blocks lie at random places
  // in the cache, so the block after next is prefetched while this one is computed.
  for (int j0 = 0, blk = 0; j0 < ctx; j0 += a.block_size, ++blk) {
   const C* kblock = kc + (head_base + static_cast<int64_t>(table[blk]) * a.block_size) * d;
   if (j0 + 2 * a.block_size < ctx) {
     prefetch_block<1>(kc + (head_base + static_cast<int64_t>(table[blk + 2]) * a.block_size) * d,
                    block_bytes);
   }
   const int rows = std::min(a.block_size, ctx - j0);
   int r = 0;
   for (; r + 4 <= rows; r += 4) {  // four keys at a time: one shared reduction
    __m512 kv[4][W];
    for (int i = 0; i < 4; ++i)
      for (int x = 0; x < w; ++x) kv[i][x] = load16(kblock + static_cast<int64_t>(r + i) * d + x * 16);
    for (int g = 0; g < group; ++g) {
      __m512 s4[4];
      for (int i = 0; i < 4; ++i) {
        s4[i] = _mm512_mul_ps(qv[g * w], kv[i][0]);
        for (int x = 1; x < w; ++x) s4[i] = _mm512_fmadd_ps(qv[g * w + x], kv[i][x], s4[i]);
      }
      _mm_storeu_ps(scores.data() + static_cast<size_t>(g) * ctx + j0 + r,
                    hsum4(s4[0], s4[1], s4[2], s4[3]));
    }
   }
   for (; r < rows; ++r) {
    const int j = j0 + r;
    const C* k = kblock + static_cast<int64_t>(r) * d;
    __m512 kv[W];
    for (int x = 0; x < w; ++x) kv[x] = load16(k + x * 16);
    for (int g = 0; g < group; ++g) {
      __m512 s = _mm512_mul_ps(qv[g * w], kv[0]);
      for (int x = 1; x < w; ++x) s = _mm512_fmadd_ps(qv[g * w + x], kv[x], s);
      scores[static_cast<size_t>(g) * ctx + j] = _mm512_reduce_add_ps(s);
    }
   }
  }
  for (int g = 0; g < group; ++g) {
    float* sg = scores.data() + static_cast<size_t>(g) * ctx;
    if (part == nullptr) {
      softmax_avx512(sg, ctx);
    } else {
      const auto [mx, sum] = exp_avx512(sg, ctx);
      part[group * d + g] = mx;
      part[group * d + group + g] = sum;
    }
  }
  for (int blk = 0; blk < std::min(2, num_ctx_blocks); ++blk) {
    prefetch_block<1>(vc + (head_base + static_cast<int64_t>(table[blk]) * a.block_size) * d,
                   block_bytes);
  }
  __m512 acc[G * W];
  for (int i = 0; i < group * w; ++i) acc[i] = _mm512_setzero_ps();
  for (int j0 = 0, blk = 0; j0 < ctx; j0 += a.block_size, ++blk) {
   const C* vblock = vc + (head_base + static_cast<int64_t>(table[blk]) * a.block_size) * d;
   if (j0 + 2 * a.block_size < ctx) {
     prefetch_block<1>(vc + (head_base + static_cast<int64_t>(table[blk + 2]) * a.block_size) * d,
                    block_bytes);
   }
   const int rows = std::min(a.block_size, ctx - j0);
   for (int r = 0; r < rows; ++r) {
    const int j = j0 + r;
    const C* v = vblock + static_cast<int64_t>(r) * d;
    __m512 vv[W];
    for (int x = 0; x < w; ++x) vv[x] = load16(v + x * 16);
    for (int g = 0; g < group; ++g) {
      const __m512 p = _mm512_set1_ps(scores[static_cast<size_t>(g) * ctx + j]);
      for (int x = 0; x < w; ++x) acc[g * w + x] = _mm512_fmadd_ps(p, vv[x], acc[g * w + x]);
    }
   }
  }
  if (part != nullptr) {
    for (int i = 0; i < group * w; ++i) _mm512_storeu_ps(part + i * 16, acc[i]);
    return;
  }
  alignas(64) float acc_buf[G * W * 16];
  const __m512 v_scale = _mm512_set1_ps(a.v_scale);
  for (int i = 0; i < group * w; ++i) _mm512_storeu_ps(acc_buf + i * 16, _mm512_mul_ps(acc[i], v_scale));
  T* out = static_cast<T*>(a.out) + (static_cast<int64_t>(b) * a.num_heads + kvh * group) * d;
  for (int i = 0; i < group * d; ++i) store(out + i, acc_buf[i]);
}

template <typename T, typename C, int W>
PartFn pick_part_group(int group) {
  switch (group) {
    case 1: return attend_part_avx512<T, C, W, 1>;
    case 2: return attend_part_avx512<T, C, W, 2>;
    case 3: return attend_part_avx512<T, C, W, 3>;
    case 4: return attend_part_avx512<T, C, W, 4>;
    case 5: return attend_part_avx512<T, C, W, 5>;
    case 6: return attend_part_avx512<T, C, W, 6>;
    case 7: return attend_part_avx512<T, C, W, 7>;
    case 8: return attend_part_avx512<T, C, W, 8>;
    default: return nullptr;
  }
}

// The vectorized part for this shape (with `part` null: a whole pair, its output written), or
// nullptr (then the portable loop runs).
template <typename T, typename C>
PartFn pick_part_avx512(int head_dim, int group) {
  if (head_dim == 64) return pick_part_group<T, C, 4>(group);
  if (head_dim == 128) return pick_part_group<T, C, 8>(group);
  return nullptr;
}
#endif

#if !defined(__AVX512F__) && defined(__AVX2__) && defined(__FMA__)
// AVX2 + FMA (Zen 2/3 and older Xeons): 8 lanes, 16 registers. Keys are walked in slices that
// stay in L1 while each query head of the group takes its turn over them, so that one head's
// query (QK) or accumulator (PV) stays in registers: W = head_dim / 8 vectors.
constexpr int SLICE = 64;  // keys per slice: 16 KiB of fp32 K (or V) rows at head_dim 64

inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const uint16_t* p) {
  const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(raw), 16));
}
#if defined(__F16C__)
// FP8 -> fp16 bits -> fp32, as load16 above.
inline __m256 load8(const fp8_e5m2* p) {
  const __m128i raw = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
  return _mm256_cvtph_ps(_mm_slli_epi16(_mm_cvtepu8_epi16(raw), 8));
}
inline __m256 load8(const fp8_e4m3* p) {
  const __m128i h = e4m3_half_bits8(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
  return _mm256_mul_ps(_mm256_cvtph_ps(h), _mm256_set1_ps(256.f));
}
#else
template <typename F>
inline __m256 load8(const F* p) {  // FP8 without F16C: the table
  return _mm256_setr_ps(to_float(p[0]), to_float(p[1]), to_float(p[2]), to_float(p[3]),
                        to_float(p[4]), to_float(p[5]), to_float(p[6]), to_float(p[7]));
}
#endif

// [sum(a), sum(b), sum(c), sum(d)]
inline __m128 hsum4_avx2(__m256 a, __m256 b, __m256 c, __m256 d) {
  const __m256 abcd = _mm256_hadd_ps(_mm256_hadd_ps(a, b), _mm256_hadd_ps(c, d));
  return _mm_add_ps(_mm256_castps256_ps128(abcd), _mm256_extractf128_ps(abcd, 1));
}

// e^x for x <= 0, as exp512 above.
inline __m256 exp256(__m256 x) {
  x = _mm256_max_ps(x, _mm256_set1_ps(-87.f));
  const __m256 t = _mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f));
  const __m256 n = _mm256_round_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m256 f = _mm256_mul_ps(_mm256_sub_ps(t, n), _mm256_set1_ps(0.6931471805599453f));
  __m256 p = _mm256_set1_ps(1.f / 5040.f);
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.f / 720.f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.f / 120.f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.f / 24.f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.f / 6.f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(0.5f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.f));
  const __m256i bits = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n),
                                                          _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(bits));
}

// Rows of the keys [j0, j0 + n) of one kv head (n <= SLICE), walking the block table.
template <typename T>
void slice_rows(const Args& a, const T* cache, const int32_t* table, int64_t head_base, int j0,
                int n, const T** rows) {
  int blk = j0 / a.block_size, off = j0 % a.block_size;
  for (int r = 0; r < n; ++r, ++off) {
    if (off == a.block_size) {
      off = 0;
      ++blk;
    }
    rows[r] = cache + (head_base + static_cast<int64_t>(table[blk]) * a.block_size + off) *
                          a.head_dim;
  }
}

// The rows of keys [j0, j0 + n) fetched ahead: the slice after the one being computed, whose
// blocks lie elsewhere in the cache, where the hardware's prefetch does not follow. 30 layers
// of SmolLM2's heads from DRAM (AVX2 Zen 3, blocks shuffled): 1.02-1.05x at 8 x 1000, 8 x 3000,
// 32 x 500 and 1 x 8000 keys. The rest of the time is compute (in cache one layer of 8 x 1000
// keys takes half the time it takes from memory, ~23% of the FMA peak).
template <typename T>
void prefetch_slice(const Args& a, const T* cache, const int32_t* table, int64_t head_base,
                    int j0, int n) {
#if !defined(PA_NO_SLICE_PREFETCH)
  const T* rows[SLICE];
  slice_rows(a, cache, table, head_base, j0, n, rows);
  const int64_t bytes = static_cast<int64_t>(a.head_dim) * sizeof(T);
  for (int r = 0; r < n; ++r) prefetch_block(rows[r], bytes);
#endif
}

// Exponentials of s[0..n) after subtracting their max, in place; returns (max, sum).
std::pair<float, float> exp_avx2(float* s, int n) {
  __m256 vmax = _mm256_set1_ps(-3.0e38f);
  int j = 0;
  for (; j + 8 <= n; j += 8) vmax = _mm256_max_ps(vmax, _mm256_loadu_ps(s + j));
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, vmax);
  float mx = lanes[0];
  for (int i = 1; i < 8; ++i) mx = std::max(mx, lanes[i]);
  for (; j < n; ++j) mx = std::max(mx, s[j]);
  const __m256 vmx = _mm256_set1_ps(mx);
  __m256 vsum = _mm256_setzero_ps();
  float sum = 0.f;
  for (j = 0; j + 8 <= n; j += 8) {
    const __m256 e = exp256(_mm256_sub_ps(_mm256_loadu_ps(s + j), vmx));
    _mm256_storeu_ps(s + j, e);
    vsum = _mm256_add_ps(vsum, e);
  }
  for (; j < n; ++j) {
    s[j] = std::exp(s[j] - mx);
    sum += s[j];
  }
  _mm256_store_ps(lanes, vsum);
  for (int i = 0; i < 8; ++i) sum += lanes[i];
  return {mx, sum};
}

// Keys [lo, hi) of one (sequence, kv head) pair: per query head of the group, the output not yet
// divided by its softmax sum (part[g * d ...]), then the max (part[group * d + g]) and the sum
// (part[group * d + group + g]) of its scores.
template <typename T, typename C, int W>
void attend_part_avx2(const Args& a, int b, int kvh, int lo, int hi, std::vector<float>& scores,
                      float* part) {
  const int group = a.num_heads / a.num_kv_heads;
  const int d = a.head_dim;
  const int ctx = hi - lo;
  const T* q = static_cast<const T*>(a.q) + (static_cast<int64_t>(b) * a.num_heads + kvh * group) * d;
  const int32_t* table = a.block_tables + static_cast<int64_t>(b) * a.max_blocks;
  const int64_t head_base = static_cast<int64_t>(kvh) * a.num_blocks * a.block_size;
  const C* kc = static_cast<const C*>(a.k_cache);
  const C* vc = static_cast<const C*>(a.v_cache);
  grown(scores, static_cast<size_t>(group) * ctx);  // every score is written before it is read
  std::fill(part, part + static_cast<size_t>(group) * d, 0.f);
  const C* rows[SLICE];
  const __m256 scale = _mm256_set1_ps(a.scale);
  for (int j0 = 0; j0 < ctx; j0 += SLICE) {
    const int n = std::min(SLICE, ctx - j0);
    slice_rows(a, kc, table, head_base, lo + j0, n, rows);
    if (j0 + SLICE < ctx) prefetch_slice(a, kc, table, head_base, lo + j0 + SLICE, std::min(SLICE, ctx - j0 - SLICE));
    for (int g = 0; g < group; ++g) {
      __m256 qv[W];
      for (int x = 0; x < W; ++x) qv[x] = _mm256_mul_ps(load8(q + g * d + x * 8), scale);
      float* sg = scores.data() + static_cast<size_t>(g) * ctx + j0;
      int r = 0;
      for (; r + 4 <= n; r += 4) {
        __m256 s4[4];
        for (int i = 0; i < 4; ++i) {
          s4[i] = _mm256_mul_ps(qv[0], load8(rows[r + i]));
          for (int x = 1; x < W; ++x) s4[i] = _mm256_fmadd_ps(qv[x], load8(rows[r + i] + x * 8), s4[i]);
        }
        _mm_storeu_ps(sg + r, hsum4_avx2(s4[0], s4[1], s4[2], s4[3]));
      }
      for (; r < n; ++r) {
        __m256 s = _mm256_mul_ps(qv[0], load8(rows[r]));
        for (int x = 1; x < W; ++x) s = _mm256_fmadd_ps(qv[x], load8(rows[r] + x * 8), s);
        const __m128 h = _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1));
        const __m128 h2 = _mm_hadd_ps(h, h);
        sg[r] = _mm_cvtss_f32(_mm_hadd_ps(h2, h2));
      }
    }
  }
  for (int g = 0; g < group; ++g) {
    const auto [mx, sum] = exp_avx2(scores.data() + static_cast<size_t>(g) * ctx, ctx);
    part[group * d + g] = mx;
    part[group * d + group + g] = sum;
  }
  for (int j0 = 0; j0 < ctx; j0 += SLICE) {
    const int n = std::min(SLICE, ctx - j0);
    slice_rows(a, vc, table, head_base, lo + j0, n, rows);
    if (j0 + SLICE < ctx) prefetch_slice(a, vc, table, head_base, lo + j0 + SLICE, std::min(SLICE, ctx - j0 - SLICE));
    for (int g = 0; g < group; ++g) {
      float* ag = part + static_cast<size_t>(g) * d;
      __m256 acc[W];
      for (int x = 0; x < W; ++x) acc[x] = _mm256_loadu_ps(ag + x * 8);
      const float* pg = scores.data() + static_cast<size_t>(g) * ctx + j0;
      for (int r = 0; r < n; ++r) {
        const __m256 p = _mm256_set1_ps(pg[r]);
        for (int x = 0; x < W; ++x) acc[x] = _mm256_fmadd_ps(p, load8(rows[r] + x * 8), acc[x]);
      }
      for (int x = 0; x < W; ++x) _mm256_storeu_ps(ag + x * 8, acc[x]);
    }
  }
}

// The vectorized part for this head size, or nullptr (then the portable loop runs).
template <typename T, typename C>
PartFn pick_avx2(int head_dim) {
  if (head_dim == 64) return attend_part_avx2<T, C, 8>;
  if (head_dim == 128) return attend_part_avx2<T, C, 16>;
  return nullptr;
}
#endif

// Softmax in place over n scores, for CPUs without AVX-512 (the compiler vectorizes what it can).
void softmax_portable(float* s, int n) {
  float mx = -3.0e38f;
  for (int j = 0; j < n; ++j) mx = std::max(mx, s[j]);
  float sum = 0.f;
  for (int j = 0; j < n; ++j) {
    s[j] = std::exp(s[j] - mx);
    sum += s[j];
  }
  const float inv = 1.f / sum;
  for (int j = 0; j < n; ++j) s[j] *= inv;
}

inline void softmax(float* s, int n) {
#if defined(__AVX512F__)
  softmax_avx512(s, n);
#else
  softmax_portable(s, n);
#endif
}

template <typename T, typename C>
void attend_pair(const Args& a, int b, int kvh, std::vector<float>& scores,
                 std::vector<float>& acc, std::vector<float>& qf) {
  const int group = a.num_heads / a.num_kv_heads;
  const int d = a.head_dim;
  const int ctx = a.context_lens[b];
  const T* q = static_cast<const T*>(a.q) + (static_cast<int64_t>(b) * a.num_heads + kvh * group) * d;
  const C* kc = static_cast<const C*>(a.k_cache);
  const C* vc = static_cast<const C*>(a.v_cache);
  const int32_t* table = a.block_tables + static_cast<int64_t>(b) * a.max_blocks;
  const int64_t head_base = static_cast<int64_t>(kvh) * a.num_blocks * a.block_size;
  scores.assign(static_cast<size_t>(group) * ctx, 0.f);
  acc.assign(static_cast<size_t>(group) * d, 0.f);
  qf.resize(static_cast<size_t>(group) * d);
  for (int i = 0; i < group * d; ++i) qf[i] = to_float(q[i]) * a.scale;

  for (int j = 0; j < ctx; ++j) {
    const int64_t row = (head_base + static_cast<int64_t>(table[j / a.block_size]) * a.block_size +
                         j % a.block_size) * d;
    const C* k = kc + row;
    for (int g = 0; g < group; ++g) {
      const float* qg = qf.data() + g * d;
      float s = 0.f;
      for (int x = 0; x < d; ++x) s += qg[x] * to_float(k[x]);
      scores[static_cast<size_t>(g) * ctx + j] = s;
    }
  }
  for (int g = 0; g < group; ++g) softmax(scores.data() + static_cast<size_t>(g) * ctx, ctx);
  for (int j = 0; j < ctx; ++j) {
    const int64_t row = (head_base + static_cast<int64_t>(table[j / a.block_size]) * a.block_size +
                         j % a.block_size) * d;
    const C* v = vc + row;
    for (int g = 0; g < group; ++g) {
      const float p = scores[static_cast<size_t>(g) * ctx + j];
      float* ag = acc.data() + g * d;
      for (int x = 0; x < d; ++x) ag[x] += p * to_float(v[x]);
    }
  }
  T* out = static_cast<T*>(a.out) + (static_cast<int64_t>(b) * a.num_heads + kvh * group) * d;
  for (int i = 0; i < group * d; ++i) store(out + i, acc[i] * a.v_scale);
}

// Pairs split into parts of at least SPLIT_KEYS keys when there are fewer pairs than work for
// every thread (one sequence: a few kv heads for all the cores), on torch's OpenMP pool; the
// parts are merged by their max and sum (flash-decoding).
constexpr int SPLIT_KEYS = 256;
constexpr int MAX_SPLIT = 64;
constexpr int SPLIT_FROM = 2048;  // AVX-512: the shortest context that splits

// With fixed_split (batch-invariant mode) a pair's parts depend on its context length alone.
// A part's first key is a multiple of `align` (the AVX-512 parts walk whole cache blocks).
template <typename T>
void run_parts(const Args& a, int num_threads, PartFn fn, bool fixed_split, int align) {
  const int group = a.num_heads / a.num_kv_heads;
  const int d = a.head_dim;
  const int pairs = a.batch * a.num_kv_heads;
  const int want = fixed_split ? MAX_SPLIT : (4 * num_threads + pairs - 1) / pairs;
  struct Task { int pair, lo, hi, slot; };
  std::vector<Task> tasks;
  std::vector<std::pair<int, int>> slots(pairs);  // first slot, parts
  for (int p = 0; p < pairs; ++p) {
    const int ctx = a.context_lens[p / a.num_kv_heads];
    const int parts = std::max(1, std::min({want, ctx / SPLIT_KEYS, MAX_SPLIT}));
    const int first = static_cast<int>(tasks.size());
    const int span = ((ctx + parts - 1) / parts + align - 1) / align * align;
    for (int lo = 0; lo < ctx; lo += span) {
      tasks.push_back({p, lo, std::min(ctx, lo + span), static_cast<int>(tasks.size())});
    }
    slots[p] = {first, static_cast<int>(tasks.size()) - first};
  }
  const size_t stride = static_cast<size_t>(group) * (d + 2);
  std::vector<float> buf(tasks.size() * stride);
  const int n = static_cast<int>(tasks.size());
  num_threads = std::max(1, std::min(num_threads, n));
#pragma omp parallel num_threads(num_threads)
  {
    std::vector<float> scores;
#pragma omp for schedule(dynamic, 1)
    for (int i = 0; i < n; ++i) {
      const Task& t = tasks[i];
      fn(a, t.pair / a.num_kv_heads, t.pair % a.num_kv_heads, t.lo, t.hi, scores,
         buf.data() + t.slot * stride);
    }
#pragma omp for schedule(static)
    for (int p = 0; p < pairs; ++p) {
      const int first = slots[p].first, parts = slots[p].second;
      T* out = static_cast<T*>(a.out) + (static_cast<int64_t>(p / a.num_kv_heads) * a.num_heads +
                                         (p % a.num_kv_heads) * group) * d;
      for (int g = 0; g < group; ++g) {
        float m = -3.0e38f;
        for (int i = 0; i < parts; ++i) m = std::max(m, buf[(first + i) * stride + group * d + g]);
        float w[MAX_SPLIT], total = 0.f;
        for (int i = 0; i < parts; ++i) {
          const float* part = buf.data() + (first + i) * stride;
          w[i] = std::exp(part[group * d + g] - m);
          total += part[group * d + group + g] * w[i];
        }
        for (int x = 0; x < d; ++x) {
          float acc = 0.f;
          for (int i = 0; i < parts; ++i) acc += buf[(first + i) * stride + g * d + x] * w[i];
          store(out + g * d + x, acc / total * a.v_scale);
        }
      }
    }
  }
}

template <typename T, typename C>
void run(const Args& a, int num_threads, bool fixed_split) {
  const int pairs = a.batch * a.num_kv_heads;
  PartFn vectorized = nullptr;
#if defined(__AVX512F__)
  vectorized = pick_part_avx512<T, C>(a.head_dim, a.num_heads / a.num_kv_heads);
  // Fewer pairs than work for every thread, not shared evenly (one sequence: 3 kv heads on 2
  // cores), and a context long enough to split: parts over the threads, merged (as on AVX2).
  // 30 layers of SmolLM2's heads, one sequence, 2-core Xeon: 1.08x at 4000 keys and 1.13x at
  // 8000 (the keys come from DRAM), 0.97-1.02x at 600-2000 (hence SPLIT_FROM).
  // Batch-invariant mode keeps whole pairs (their bits then do not depend on the batch).
  if (vectorized != nullptr && !fixed_split && pairs < 4 * num_threads &&
      pairs % num_threads != 0) {
    bool long_context = false;
    for (int b = 0; b < a.batch; ++b) long_context |= a.context_lens[b] >= SPLIT_FROM;
    if (long_context) {
      run_parts<T>(a, num_threads, vectorized, false, a.block_size);
      return;
    }
  }
#elif defined(__AVX2__) && defined(__FMA__)
  if (PartFn part = pick_avx2<T, C>(a.head_dim)) {
    run_parts<T>(a, num_threads, part, fixed_split, 1);
    return;
  }
#endif
  num_threads = std::max(1, std::min(num_threads, pairs));
  // torch's OpenMP pool: its threads are awake right after the previous op, where new
  // std::threads had to wait for cores those spinning threads held (~0.4 ms a call at batch 1)
#pragma omp parallel num_threads(num_threads)
  {
    std::vector<float> scores, acc, qf;
#pragma omp for schedule(dynamic, 1)
    for (int p = 0; p < pairs; ++p) {
      if (vectorized != nullptr) {
        const int b = p / a.num_kv_heads;
        vectorized(a, b, p % a.num_kv_heads, 0, a.context_lens[b], scores, nullptr);
      } else {
        attend_pair<T, C>(a, p / a.num_kv_heads, p % a.num_kv_heads, scores, acc, qf);
      }
    }
  }
}

template <typename T>
int run_cache(int kv_code, const Args& a, int num_threads, bool fixed_split) {
  switch (kv_code) {
    case 0: run<T, T>(a, num_threads, fixed_split); return 0;
    case 1: run<T, fp8_e4m3>(a, num_threads, fixed_split); return 0;
    case 2: run<T, fp8_e5m2>(a, num_threads, fixed_split); return 0;
    default: return 3;
  }
}

}  // namespace

extern "C" int paged_decode_attention(
    int dtype_code,  // q and out: 0 = float32, 1 = bfloat16
    int kv_code,     // the caches: 0 = as q, 1 = fp8 e4m3, 2 = fp8 e5m2
    const void* q, const void* k_cache, const void* v_cache, const int32_t* block_tables,
    const int32_t* context_lens, void* out, int batch, int num_heads, int num_kv_heads,
    int head_dim, int num_blocks, int block_size, int max_blocks, float scale, float v_scale,
    int num_threads, int fixed_split) {
  Args a{q, k_cache, v_cache, block_tables, context_lens, out, batch, num_heads, num_kv_heads,
         head_dim, num_blocks, block_size, max_blocks, scale, v_scale};
  if (num_heads % num_kv_heads != 0) return 1;
  if (dtype_code == 0) return run_cache<float>(kv_code, a, num_threads, fixed_split != 0);
  if (dtype_code == 1) return run_cache<uint16_t>(kv_code, a, num_threads, fixed_split != 0);
  return 2;
}

// Entries for a captured step's list of calls (packed_call.h).
PAGELLM_PACKED(paged_decode_attention)
