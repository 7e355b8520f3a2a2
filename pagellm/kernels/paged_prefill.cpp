// Paged prefill/extend attention for the CPU, flash-attention style: every query token of a chunk
// attends to its sequence's cached prefix (full) and to the chunk itself (causal), reading K and
// V through the block table, tiled over keys with an online softmax. Nothing scales with
// chunk x context: each work item holds one query tile and one key tile at a time (L1-sized).
//
// Layout: q/out [tokens, num_heads, head_dim]; each cache [kv_heads, blocks, block_size, dim].
// A work item is (chunk, kv head, up to ROWS query rows), a row being one (token, query head of
// the kv head's group) pair, so grouped-query heads share every K/V load. Scores are computed
// transposed, S^T[key][row], so that rows run along the vector lanes: the K and V elements are
// broadcast scalars read in place (fp32) or from a converted key tile (bf16), the softmax max,
// exp and sum are lane-parallel, and no K^T packing is needed. Accumulation is fp32.
//
// The cache's elements are q's type (fp32 or bf16) or FP8 bytes (E4M3 / E5M2), converted into
// the key tile; an FP8 cache holds K / k_scale and V / v_scale: k_scale is folded into `scale` by
// the caller, v_scale multiplies the output.
//
// The vector width comes from the CPU at build time (cpu_common.h).
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "cpu_common.h"

namespace {

using namespace pagellm;
typedef int32_t vi __attribute__((vector_size(VW * 4)));

// Register blocking, measured on a Zen 2/3 EPYC (AVX2, 16 registers): 2 vectors of rows x 6 keys
// (QK) or 6 head dims (PV) = 12 accumulators, and key tiles of 48 (a multiple of 6) ran 1.6x
// faster than 4 x 2 with tiles of 32. The PP_* macros let a benchmark try other shapes.
#ifndef PP_MV
#define PP_MV 2
#endif
#ifndef PP_NQK
#define PP_NQK 6
#endif
#ifndef PP_NPV
#define PP_NPV 6
#endif
#ifndef PP_BK
#define PP_BK 48
#endif
constexpr int MV = PP_MV;      // vectors per row of lanes
constexpr int ROWS = MV * VW;  // query rows per work item (lanes of the score tiles)
constexpr int BK = PP_BK;      // keys per tile
constexpr int NJ = PP_NQK;     // keys per QK micro-step (NJ * MV accumulators)
constexpr int NP = PP_NPV;     // head dims per PV micro-step (NP * MV accumulators)

inline vf splat(float x) { return vf{} + x; }
inline vf vmax(vf a, vf b) { return a > b ? a : b; }

// e^x for x <= 0 (after subtracting a row max; -inf gives 0): 2^(x log2 e) = 2^n * 2^f with
// 2^f from a degree-7 Taylor series on |f| <= ln2 / 2 (relative error ~5e-9).
inline vf vexp(vf x) {
  x = x < splat(-87.f) ? splat(-87.f) : x;
  const vf t = x * 1.44269504088896341f;
  const vi n = __builtin_convertvector(t - 0.5f, vi);  // t <= 0: truncation rounds to nearest
  const vf f = (t - __builtin_convertvector(n, vf)) * 0.6931471805599453f;
  vf p = splat(1.f / 5040.f);
  p = p * f + 1.f / 720.f;
  p = p * f + 1.f / 120.f;
  p = p * f + 1.f / 24.f;
  p = p * f + 1.f / 6.f;
  p = p * f + 0.5f;
  p = p * f + 1.f;
  p = p * f + 1.f;
  vi bits = (n + 127) << 23;
  vf scale;
  std::memcpy(&scale, &bits, sizeof scale);
  return p * scale;
}


struct Args {
  const void* q;
  const void* k_cache;
  const void* v_cache;
  const int32_t* block_tables;  // [chunks, max_blocks]
  const int32_t* query_starts;  // [chunks + 1]: each chunk's first token in q
  const int32_t* start_pos;     // [chunks]: tokens cached before the chunk
  void* out;
  int num_heads, num_kv_heads, head_dim, num_blocks, block_size, max_blocks;
  float scale;
  float v_scale;
};

struct Item {
  int chunk, kv_head, row0, rows;
  int64_t cost;
  int key_lo = 0, key_hi = -1;  // this item's keys (key_hi -1: up to the last row's position)
  int part = -1;                // where a split item leaves its partial result (-1: not split)
};

// A split item writes O^T unnormalized with its rows' running max and sum; merged afterwards.
struct Partials {
  int d;
  std::vector<float> data;
  float* ot(int part) { return data.data() + static_cast<size_t>(part) * stride(); }
  float* mx(int part) { return ot(part) + static_cast<size_t>(d) * ROWS; }
  float* sum(int part) { return mx(part) + ROWS; }
  size_t stride() const { return static_cast<size_t>(d) * ROWS + 2 * ROWS; }
};

// Per-thread scratch, sized once per call: nothing here grows with the context.
struct Scratch {
  std::vector<float> qt, ot, st, kbuf, vbuf;
  std::vector<const float*> krow, vrow;
  explicit Scratch(int d)
      : qt(static_cast<size_t>(d) * ROWS), ot(static_cast<size_t>(d) * ROWS),
        st(static_cast<size_t>(BK) * ROWS), kbuf(static_cast<size_t>(BK) * d),
        vbuf(static_cast<size_t>(BK) * d), krow(BK), vrow(BK) {}
};

// Pointers to the fp32 rows of keys [k0, k0 + n) of one kv head: in place for an fp32 cache,
// converted into `buf` for bf16 and FP8.
template <typename T>
void key_rows(const Args& a, const T* cache, const int32_t* table, int64_t head_base, int k0,
              int n, float* buf, const float** rows) {
  const int d = a.head_dim;
  int blk = k0 / a.block_size, off = k0 % a.block_size;  // walked, not divided per key
  for (int j = 0; j < n; ++j, ++off) {
    if (off == a.block_size) {
      off = 0;
      ++blk;
    }
    const T* src =
        cache + (head_base + static_cast<int64_t>(table[blk]) * a.block_size + off) * d;
    if constexpr (sizeof(T) == sizeof(float)) {
      rows[j] = reinterpret_cast<const float*>(src);
    } else {
      float* dst = buf + static_cast<size_t>(j) * d;
      for (int x = 0; x < d; ++x) dst[x] = to_float(src[x]);
      rows[j] = dst;
    }
  }
}

// S^T[j][:] = sum_d K[j][d] * Q^T[d][:] for the n keys of the tile (NJ keys per micro-step).
void scores_tile(const float* qt, const float* const* krow, int n, int d, float* st) {
  int j = 0;
  for (; j + NJ <= n; j += NJ) {
    vf acc[NJ][MV] = {};
    for (int x = 0; x < d; ++x) {
      vf qv[MV];
      for (int v = 0; v < MV; ++v) qv[v] = loadv(qt + x * ROWS + v * VW);
      for (int k = 0; k < NJ; ++k) {
        const vf kb = splat(krow[j + k][x]);
        for (int v = 0; v < MV; ++v) acc[k][v] += kb * qv[v];
      }
    }
    for (int k = 0; k < NJ; ++k)
      for (int v = 0; v < MV; ++v) storev(st + (j + k) * ROWS + v * VW, acc[k][v]);
  }
  for (; j < n; ++j) {
    vf acc[MV] = {};
    for (int x = 0; x < d; ++x) {
      const vf kb = splat(krow[j][x]);
      for (int v = 0; v < MV; ++v) acc[v] += kb * loadv(qt + x * ROWS + v * VW);
    }
    for (int v = 0; v < MV; ++v) storev(st + j * ROWS + v * VW, acc[v]);
  }
}

// O^T[x][:] = O^T[x][:] * alpha + sum_j V[j][x] * P^T[j][:] (NJ dims per micro-step).
void accumulate_tile(const float* st, const float* const* vrow, int n, int d, const vf* alpha,
                     float* ot) {
  int x = 0;
  for (; x + NP <= d; x += NP) {
    vf acc[NP][MV];
    for (int k = 0; k < NP; ++k)
      for (int v = 0; v < MV; ++v) acc[k][v] = loadv(ot + (x + k) * ROWS + v * VW) * alpha[v];
    for (int j = 0; j < n; ++j) {
      vf pv[MV];
      for (int v = 0; v < MV; ++v) pv[v] = loadv(st + j * ROWS + v * VW);
      for (int k = 0; k < NP; ++k) {
        const vf vb = splat(vrow[j][x + k]);
        for (int v = 0; v < MV; ++v) acc[k][v] += vb * pv[v];
      }
    }
    for (int k = 0; k < NP; ++k)
      for (int v = 0; v < MV; ++v) storev(ot + (x + k) * ROWS + v * VW, acc[k][v]);
  }
  for (; x < d; ++x) {
    vf acc[MV];
    for (int v = 0; v < MV; ++v) acc[v] = loadv(ot + x * ROWS + v * VW) * alpha[v];
    for (int j = 0; j < n; ++j) {
      const vf vb = splat(vrow[j][x]);
      for (int v = 0; v < MV; ++v) acc[v] += vb * loadv(st + j * ROWS + v * VW);
    }
    for (int v = 0; v < MV; ++v) storev(ot + x * ROWS + v * VW, acc[v]);
  }
}

template <typename T, typename C>
void attend_item(const Args& a, const Item& it, Scratch& s, Partials& partials) {
  const int d = a.head_dim;
  const int group = a.num_heads / a.num_kv_heads;
  const int start = a.start_pos[it.chunk];
  const int tok0 = a.query_starts[it.chunk];
  const int32_t* table = a.block_tables + static_cast<int64_t>(it.chunk) * a.max_blocks;
  const int64_t head_base = static_cast<int64_t>(it.kv_head) * a.num_blocks * a.block_size;
  const T* q = static_cast<const T*>(a.q);

  // Q^T [d][ROWS] (scaled), each row's position; padding rows see every key with q = 0.
  std::fill(s.qt.begin(), s.qt.end(), 0.f);
  alignas(64) float pos[ROWS];
  for (int r = 0; r < ROWS; ++r) {
    if (r >= it.rows) {
      pos[r] = 3.0e9f;
      continue;
    }
    const int row = it.row0 + r;
    const int tok = row / group;
    pos[r] = static_cast<float>(start + tok);
    const T* src = q + (static_cast<int64_t>(tok0 + tok) * a.num_heads + it.kv_head * group +
                        row % group) * d;
    for (int x = 0; x < d; ++x) s.qt[x * ROWS + r] = to_float(src[x]) * a.scale;
  }
  std::fill(s.ot.begin(), s.ot.end(), 0.f);
  vf mx[MV], sum[MV], posv[MV];
  for (int v = 0; v < MV; ++v) {
    mx[v] = splat(-INFINITY);
    sum[v] = splat(0.f);
    posv[v] = loadv(pos + v * VW);
  }
  // Keys up to the last row's own position; rows before it are masked causally.
  const int first_pos = start + it.row0 / group;
  const int last_key = start + (it.row0 + it.rows - 1) / group + 1;
  const int kv_end = it.key_hi < 0 ? last_key : std::min(it.key_hi, last_key);
  const C* kc = static_cast<const C*>(a.k_cache);
  const C* vc = static_cast<const C*>(a.v_cache);
  // Every row sees the first key of the range (a split starts within the cached prefix), so
  // each row's max is finite after the first tile.
  for (int k0 = it.key_lo; k0 < kv_end; k0 += BK) {
    const int n = std::min(BK, kv_end - k0);
    key_rows(a, kc, table, head_base, k0, n, s.kbuf.data(), s.krow.data());
    scores_tile(s.qt.data(), s.krow.data(), n, d, s.st.data());
    if (k0 + n - 1 > first_pos) {  // the tile reaches past the first row: causal mask
      for (int j = 0; j < n; ++j) {
        const vf key = splat(static_cast<float>(k0 + j));
        for (int v = 0; v < MV; ++v) {
          float* p = s.st.data() + j * ROWS + v * VW;
          storev(p, key > posv[v] ? splat(-INFINITY) : loadv(p));
        }
      }
    }
    vf alpha[MV];
    for (int v = 0; v < MV; ++v) {
      vf tile_max = splat(-INFINITY);
      for (int j = 0; j < n; ++j) tile_max = vmax(tile_max, loadv(s.st.data() + j * ROWS + v * VW));
      const vf new_max = vmax(mx[v], tile_max);
      alpha[v] = vexp(mx[v] - new_max);
      vf tile_sum = splat(0.f);
      for (int j = 0; j < n; ++j) {
        float* p = s.st.data() + j * ROWS + v * VW;
        const vf e = vexp(loadv(p) - new_max);
        storev(p, e);
        tile_sum += e;
      }
      sum[v] = sum[v] * alpha[v] + tile_sum;
      mx[v] = new_max;
    }
    key_rows(a, vc, table, head_base, k0, n, s.vbuf.data(), s.vrow.data());
    accumulate_tile(s.st.data(), s.vrow.data(), n, d, alpha, s.ot.data());
  }
  if (it.part >= 0) {
    std::copy(s.ot.begin(), s.ot.end(), partials.ot(it.part));
    for (int v = 0; v < MV; ++v) {
      storev(partials.mx(it.part) + v * VW, mx[v]);
      storev(partials.sum(it.part) + v * VW, sum[v]);
    }
    return;
  }
  alignas(64) float inv[ROWS];
  for (int v = 0; v < MV; ++v) storev(inv + v * VW, 1.f / sum[v]);
  for (int r = 0; r < ROWS; ++r) inv[r] *= a.v_scale;
  T* out = static_cast<T*>(a.out);
  for (int r = 0; r < it.rows; ++r) {
    const int row = it.row0 + r;
    const int tok = row / group;
    T* dst = out + (static_cast<int64_t>(tok0 + tok) * a.num_heads + it.kv_head * group +
                    row % group) * d;
    for (int x = 0; x < d; ++x) store(dst + x, s.ot[x * ROWS + r] * inv[r]);
  }
}

// Work items, the costliest (longest key range) first so that threads finish together. When
// there are too few to keep every thread busy (a short chunk over a long prefix: a handful of
// items), each is split over its cached prefix into parts of at least SPLIT_MIN keys, merged
// afterwards (flash-decoding's split of the keys).
constexpr int SPLIT_MIN = 512;
constexpr int MAX_PARTS = 64;

struct Plan {
  std::vector<Item> items;
  std::vector<std::pair<int, int>> splits;  // (first part's item index in `whole`, parts)
  std::vector<Item> whole;                  // the split items before splitting
};

Plan make_plan(const Args& a, int num_chunks, int num_threads) {
  const int group = a.num_heads / a.num_kv_heads;
  Plan plan;
  std::vector<Item> base;
  for (int c = 0; c < num_chunks; ++c) {
    const int rows = (a.query_starts[c + 1] - a.query_starts[c]) * group;
    for (int h = 0; h < a.num_kv_heads; ++h) {
      for (int r0 = 0; r0 < rows; r0 += ROWS) {
        const int n = std::min(ROWS, rows - r0);
        const int64_t keys = a.start_pos[c] + (r0 + n - 1) / group + 1;
        base.push_back({c, h, r0, n, keys * n});
      }
    }
  }
  if (base.empty()) return plan;
  const int want = static_cast<int>((4 * num_threads + base.size() - 1) / base.size());
  int num_parts = 0;
  for (const Item& it : base) {
    const int start = a.start_pos[it.chunk];
    const int parts = std::min({want, start / SPLIT_MIN, MAX_PARTS});
    if (num_threads < 2 || parts < 2) {
      plan.items.push_back(it);
      continue;
    }
    const int span = start / parts;
    for (int p = 0; p < parts; ++p) {
      Item part = it;
      part.key_lo = p * span;
      part.key_hi = p + 1 < parts ? (p + 1) * span : -1;
      part.cost = it.cost / parts;
      part.part = num_parts + p;
      plan.items.push_back(part);
    }
    plan.splits.push_back({num_parts, parts});
    plan.whole.push_back(it);
    num_parts += parts;
  }
  std::sort(plan.items.begin(), plan.items.end(),
            [](const Item& x, const Item& y) { return x.cost > y.cost; });
  return plan;
}

// out = sum_p O_p e^(m_p - m) / sum_p l_p e^(m_p - m) for each split item's rows.
template <typename T>
void merge_split(const Args& a, const Item& it, int first, int parts, Partials& partials) {
  const int d = a.head_dim;
  const int group = a.num_heads / a.num_kv_heads;
  const int tok0 = a.query_starts[it.chunk];
  T* out = static_cast<T*>(a.out);
  for (int r = 0; r < it.rows; ++r) {
    float m = -INFINITY;
    for (int p = 0; p < parts; ++p) m = std::max(m, partials.mx(first + p)[r]);
    float total = 0.f;
    float weight[MAX_PARTS];
    for (int p = 0; p < parts; ++p) {
      weight[p] = std::exp(partials.mx(first + p)[r] - m);
      total += partials.sum(first + p)[r] * weight[p];
    }
    const int row = it.row0 + r;
    T* dst = out + (static_cast<int64_t>(tok0 + row / group) * a.num_heads + it.kv_head * group +
                    row % group) * d;
    for (int x = 0; x < d; ++x) {
      float acc = 0.f;
      for (int p = 0; p < parts; ++p) acc += partials.ot(first + p)[x * ROWS + r] * weight[p];
      store(dst + x, acc / total * a.v_scale);
    }
  }
}

// Threads come from the OpenMP runtime torch already loaded (the library links libgomp by its
// soname), so the kernel runs on torch's own pool: no threads of ours spinning against torch's.
template <typename T, typename C>
void run(const Args& a, int num_chunks, int num_threads) {
  const Plan plan = make_plan(a, num_chunks, std::max(1, num_threads));
  const int n = static_cast<int>(plan.items.size());
  int num_parts = 0;
  for (const auto& sp : plan.splits) num_parts += sp.second;
  Partials partials{a.head_dim, {}};
  partials.data.resize(static_cast<size_t>(num_parts) * partials.stride());
  num_threads = std::max(1, std::min(num_threads, n));
#pragma omp parallel num_threads(num_threads)
  {
    Scratch scratch(a.head_dim);
#pragma omp for schedule(dynamic, 1)
    for (int i = 0; i < n; ++i) attend_item<T, C>(a, plan.items[i], scratch, partials);
#pragma omp for schedule(static)
    for (int i = 0; i < static_cast<int>(plan.splits.size()); ++i) {
      merge_split<T>(a, plan.whole[i], plan.splits[i].first, plan.splits[i].second, partials);
    }
  }
}

template <typename T>
int run_cache(int kv_code, const Args& a, int num_chunks, int num_threads) {
  switch (kv_code) {
    case 0: run<T, T>(a, num_chunks, num_threads); return 0;
    case 1: run<T, fp8_e4m3>(a, num_chunks, num_threads); return 0;
    case 2: run<T, fp8_e5m2>(a, num_chunks, num_threads); return 0;
    default: return 3;
  }
}

}  // namespace

extern "C" int paged_prefill_attention(
    int dtype_code,  // q and out: 0 = float32, 1 = bfloat16
    int kv_code,     // the caches: 0 = as q, 1 = fp8 e4m3, 2 = fp8 e5m2
    const void* q, const void* k_cache, const void* v_cache, const int32_t* block_tables,
    const int32_t* query_starts, const int32_t* start_pos, void* out, int num_chunks,
    int num_heads, int num_kv_heads, int head_dim, int num_blocks, int block_size, int max_blocks,
    float scale, float v_scale, int num_threads) {
  if (num_kv_heads <= 0 || num_heads % num_kv_heads != 0) return 1;
  Args a{q,         k_cache,      v_cache,  block_tables, query_starts, start_pos, out,
         num_heads, num_kv_heads, head_dim, num_blocks,   block_size,   max_blocks, scale,
         v_scale};
  if (dtype_code == 0) return run_cache<float>(kv_code, a, num_chunks, num_threads);
  if (dtype_code == 1) return run_cache<uint16_t>(kv_code, a, num_chunks, num_threads);
  return 2;
}

extern "C" int paged_prefill_vector_width() { return VW; }
