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
// exp and sum are lane-parallel, and no K^T packing is needed. Accumulation is fp32. Where the
// CPU has AMX and q and the cache are bf16, the items' two products run on tiles instead
// (vector_amx_scores, vector_amx_pv): K rows as stored are the A tiles of S^T = K Q^T. Where it
// has AVX-512 BF16 but no AMX (Zen 4 / Zen 5) the same products run as soft tiles, AVX-512 BF16
// dot products over the tiles' operands: on a 2-core Zen 4 EPYC, one layer of SmolLM2's heads,
// a 2048-token chunk over 6144 cached keys took 108 ms against 214 on the float32 vector path.
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
#include <type_traits>
#include <vector>

#include "amx_common.h"
#include "aligned_vector.h"
#include "cpu_common.h"
#include "tile_transpose.h"
#include "packed_call.h"

// The vector path's two products as AMX tile operations (16 x 16 fp32 C tiles, bf16 pairs): on
// AMX, or where the CPU has AVX-512 BF16 and no AMX (AMD Zen 4 / Zen 5) with its dot products
// standing in for the tiles (soft tiles: same operands, same layouts, C in registers).
#if defined(PAGELLM_HAS_AMX)
#define PP_TILES 1
#elif defined(__AVX512BF16__) && defined(__AVX512BW__)
#include <immintrin.h>
#define PP_TILES 1
#define PP_SOFT_TILES 1
#endif

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
constexpr int HALF_ROWS = 16;  // rows of half an item of the AMX products (one C tile's)
constexpr int BK = PP_BK;      // keys per tile
constexpr int NJ = PP_NQK;     // keys per QK micro-step (NJ * MV accumulators)
constexpr int NP = PP_NPV;     // head dims per PV micro-step (NP * MV accumulators)

inline vf splat(float x) { return vf{} + x; }
inline vf vmax(vf a, vf b) { return a > b ? a : b; }
inline bool any_above(vf a, vf b) {
  for (int i = 0; i < VW; ++i)
    if (a[i] > b[i]) return true;
  return false;
}
// How far past a row's running max its scores may go before the max (and O) move, on the AMX
// products' path: 8 ln 2, so that P <= 256.
constexpr float LAZY_MAX = 5.545177444479562f;

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


#ifndef PP_VECTOR_AMX
#define PP_VECTOR_AMX 1
#endif

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
  const uint8_t* amx_chunks = nullptr;  // chunks the AMX path takes (the vector path skips them)
  bool vector_amx = false;              // the vector path's two products on AMX tiles (bf16)
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
  AlignedVector<float> qt, ot, st, kbuf, vbuf;
  std::vector<const float*> krow, vrow;
  explicit Scratch(int d)
      : qt(static_cast<size_t>(d) * ROWS), ot(static_cast<size_t>(d) * ROWS),
        st(static_cast<size_t>(std::max(BK, 64)) * ROWS), kbuf(static_cast<size_t>(BK) * d),
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

#if defined(PP_TILES)
#if defined(PP_SOFT_TILES)
// AMX's TDPBF16PS for C tiles held in registers: c[i] (16 fp32 lanes: B's columns) += the sum
// over p < 16 of A's row i pair p (two bf16, broadcast) times B's row p (16 bf16 pairs). A: R
// rows of 32 bf16, a_stride elements apart; B: 16 rows of 64 bytes, contiguous.
template <int R>
inline void soft_dp(__m512 (&c)[R], const uint16_t* a, int64_t a_stride, const uint16_t* b) {
  for (int p = 0; p < 16; ++p) {
    const __m512bh bp = reinterpret_cast<__m512bh>(_mm512_loadu_si512(b + p * 32));
    for (int i = 0; i < R; ++i) {
      int32_t pair;
      std::memcpy(&pair, a + i * a_stride + 2 * p, 4);
      c[i] = _mm512_dpbf16_ps(c[i], reinterpret_cast<__m512bh>(_mm512_set1_epi32(pair)), bp);
    }
  }
}

// The same for two C tiles that share A (B0 into c0, B1 into c1): each broadcast serves both
// (each product taking its pair from memory as an embedded {1to16} broadcast instead: 2x the
// kernel's time on a Zen 4, 10 tokens over 7000 keys).
template <int R>
inline void soft_dp2(__m512 (&c0)[R], __m512 (&c1)[R], const uint16_t* a, int64_t a_stride,
                     const uint16_t* b0, const uint16_t* b1) {
  for (int p = 0; p < 16; ++p) {
    const __m512bh p0 = reinterpret_cast<__m512bh>(_mm512_loadu_si512(b0 + p * 32));
    const __m512bh p1 = reinterpret_cast<__m512bh>(_mm512_loadu_si512(b1 + p * 32));
    for (int i = 0; i < R; ++i) {
      int32_t pair;
      std::memcpy(&pair, a + i * a_stride + 2 * p, 4);
      const __m512bh ap = reinterpret_cast<__m512bh>(_mm512_set1_epi32(pair));
      c0[i] = _mm512_dpbf16_ps(c0[i], ap, p0);
      c1[i] = _mm512_dpbf16_ps(c1[i], ap, p1);
    }
  }
}
#endif

// The vector path's scores on AMX tiles, K used where it lies (no packing, unlike the AMX path
// below, which pays for packing every key the chunk sees and so only takes chunks of many rows):
// S^T (16 keys x 16 rows) = K (16 keys x 32 dims: an A tile read straight from a cache block) .
// Q^T (32 dims in pairs x 16 rows: a B tile), summed over the head dim's 32-wide slices, two C
// tiles for the item's 32 rows. q goes in unscaled (bf16 as it is); the scale comes after. With
// the products with V on tiles too (vector_amx_pv), 30 layers of SmolLM2's heads on a 2-core
// Xeon, 5-11 tokens over 2000-7900 cached keys: 1.5-1.8x the vector path's speed, the degree-3
// 2^x for P (rounded to bf16 anyway) included, which gave 1.05-1.09x of it. Then 64 keys a
// softmax step (O one trip through the C tiles for two P V products), V packed before the
// softmax and O rescaled only when a row's max moves past LAZY_MAX: 1.06-1.20x on 10 tokens
// over 7000 keys, and a mixed step of 8 decodes and such a chunk 48 -> 35 ms (30 layers).
// Then the scale folded into the exponent and each step's max found in the pass that
// exponentiates (amx_softmax_step: two passes over S^T fewer): 1.03-1.09x on 24-30 tokens over
// 1000-2000 keys, where the arithmetic is the bound; none on 10 tokens over 7000, which waits
// on memory (~10 GB/s of K and V then, what a plain sum of a large tensor read that hour).
// Tiles: 0 K, 1-2 Q^T halves, 3-4 S^T halves (the standard configuration of amx_common.h).
//
// Q^T of query rows [row0, row0 + rows) (at most 32) of an item, unscaled, in B-tile form
// [d / 32][row half][16 dim pairs][16 rows][2] (bf16), zeros for the missing rows: the B tiles
// of S^T = K Q^T, for the vector path's items and the AMX path's sub-blocks alike.
// Per 16 rows and 32 dims: the rows' 16 dim pairs (dwords) transposed, so that each dim pair's
// 16 rows are one 64-byte line of the tile (a scalar element loop took 17% of a 1024-token
// prefill's attention).
void pack_qt(const Args& a, const Item& it, int row0, int rows, uint16_t* qt) {
  const int d = a.head_dim, group = a.num_heads / a.num_kv_heads;
  const uint16_t* q = static_cast<const uint16_t*>(a.q);
  const int tok0 = a.query_starts[it.chunk];
  for (int rh = 0; rh < 2; ++rh) {
    const uint16_t* src[16];
    for (int rr = 0; rr < 16; ++rr) {
      const int r = rh * 16 + rr, row = row0 + r;
      src[rr] = r < rows ? q + (static_cast<int64_t>(tok0 + row / group) * a.num_heads +
                                it.kv_head * group + row % group) * d
                         : nullptr;
    }
    for (int dh = 0; dh < d / 32; ++dh) {
      __m512i v[16];
      for (int rr = 0; rr < 16; ++rr)
        v[rr] = src[rr] ? _mm512_loadu_si512(src[rr] + dh * 32) : _mm512_setzero_si512();
      transpose16(v);
      uint16_t* dst = qt + (dh * 2 + rh) * 512;
      for (int dp = 0; dp < 16; ++dp) _mm512_storeu_si512(dst + dp * 32, v[dp]);
    }
  }
}

// S^T[j][row] for keys [k0, k0 + n) (k0 a multiple of 16, the block size a multiple of 16); rows
// of st past n get what the last block's spare rows give, and are not read. halves: 1 when the
// item has at most 16 rows (the second half of S^T is then neither computed nor read).
void vector_amx_scores(const Args& a, const uint16_t* kc, const int32_t* table, int64_t head_base,
                       int k0, int n, const uint16_t* qt, int halves, float* st) {
  const int d = a.head_dim;
  for (int j = 0; j < n; j += 16) {
    const int key = k0 + j;
    const uint16_t* rows = kc + (head_base + static_cast<int64_t>(table[key / a.block_size]) *
                                                 a.block_size + key % a.block_size) * d;
#if defined(PP_SOFT_TILES)
    float* dst = st + static_cast<size_t>(j) * ROWS;
    if (halves == 2) {  // 8 keys at a time against both row halves: 16 accumulators
      for (int k8 = 0; k8 < 16; k8 += 8) {
        __m512 lo[8] = {}, hi[8] = {};
        for (int x = 0; x < d / 32; ++x)
          soft_dp2(lo, hi, rows + k8 * d + x * 32, d, qt + (x * 2) * 512, qt + (x * 2 + 1) * 512);
        for (int i = 0; i < 8; ++i) {
          _mm512_storeu_ps(dst + (k8 + i) * ROWS, lo[i]);
          _mm512_storeu_ps(dst + (k8 + i) * ROWS + 16, hi[i]);
        }
      }
    } else {
      __m512 acc[16] = {};
      for (int x = 0; x < d / 32; ++x) soft_dp(acc, rows + x * 32, d, qt + (x * 2) * 512);
      for (int i = 0; i < 16; ++i) _mm512_storeu_ps(dst + i * ROWS, acc[i]);
    }
#else
    _tile_zero(3);
    if (halves == 2) _tile_zero(4);
    for (int x = 0; x < d / 32; ++x) {
      _tile_loadd(0, rows + x * 32, d * 2);
      _tile_loadd(1, qt + (x * 2) * 512, 64);
      _tile_dpbf16ps(3, 0, 1);
      if (halves == 2) {
        _tile_loadd(2, qt + (x * 2 + 1) * 512, 64);
        _tile_dpbf16ps(4, 0, 2);
      }
    }
    _tile_stored(3, st + static_cast<size_t>(j) * ROWS, ROWS * 4);
    if (halves == 2) _tile_stored(4, st + static_cast<size_t>(j) * ROWS + 16, ROWS * 4);
#endif
  }
}
#endif

// 2^x as 2^round(x) times a polynomial of the rest f (|f| <= 1/2), coefficients from the
// highest power; N: the polynomial's terms. Without AVX-512 (or 8 lanes) e^(x ln 2).
template <int N>
inline vf exp2_poly(vf x, const float (&c)[N]) {
#if defined(__AVX512F__)
  if constexpr (VW == 16) {
    __m512 t;
    std::memcpy(&t, &x, 64);
    const __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m512 f = _mm512_sub_ps(t, n);
    __m512 p = _mm512_set1_ps(c[0]);
    for (int i = 1; i < N; ++i) p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(c[i]));
    p = _mm512_scalef_ps(p, n);
    vf r;
    std::memcpy(&r, &p, 64);
    return r;
  }
#endif
  return vexp(x * 0.6931471805599453f);
}

// 2^x for x <= 0 (-inf gives 0), degree 5 (relative error ~3e-6): the rescale factors.
inline vf vexp2(vf x) {
  static constexpr float c[6] = {1.3333558e-3f, 9.6181291e-3f, 5.5504109e-2f,
                                 0.24022651f,   0.69314718f,   1.f};
  return exp2_poly(x > splat(-126.f) ? x : splat(-126.f), c);  // NaN and -inf: -126
}

// 2^x for finite x (no clamp: masked scores are -1e30, not -inf), degree 3 (relative error
// 7.5e-5, under bf16's rounding of P, 2e-3): the softmax's probabilities. With AVX-512 the
// reduction is to f = x - floor(x) in [0, 1), one vreduceps, as vscalefps floors its exponent
// by itself (where rounding to nearest takes a round and a subtraction): the softmax of the
// AMX path is bound by its vector instructions, two a cycle.
inline vf vexp2_p(vf x) {
#if defined(__AVX512DQ__)
  if constexpr (VW == 16) {
    static constexpr float c[4] = {7.8024326e-2f, 0.22606729f, 0.69583356f, 0.99992521f};
    __m512 t;
    std::memcpy(&t, &x, 64);
    const __m512 p = exp2_floor_poly(t, c);
    vf r;
    std::memcpy(&r, &p, 64);
    return r;
  }
#endif
  static constexpr float c[4] = {5.5171669e-2f, 0.24261115f, 0.69326097f, 0.99992806f};
  return exp2_poly(x, c);
}

// Scores S^T [key][ROWS] of keys from k0, in the first `vecs` vectors of rows: those past a
// row's position (posv) become `masked`.
inline void mask_past(float* st, int n, int k0, const vf* posv, vf masked, int vecs = MV) {
  for (int j = 0; j < n; ++j) {
    const vf key = splat(static_cast<float>(k0 + j));
    for (int v = 0; v < vecs; ++v) {
      float* p = st + j * ROWS + v * VW;
      storev(p, key > posv[v] ? masked : loadv(p));
    }
  }
}

#if defined(PP_TILES)
// One softmax step of the AMX products' path over raw scores S^T (st: [key][ROWS], q.k
// unscaled): keys past a row's position are masked where mask_k0 >= 0 (the step's first key),
// P = 2^((s - m) scale log2 e) goes to pt, its sums into sum. The running max m is kept in raw
// units and moves lazily: the pass that finds the step's max exponentiates against the current
// m, and the step is done again against a new one only where some row passed m by more than
// LAZY_MAX (the first step of an item always: m starts at -inf). alpha gets O's rescale factors
// where m moved; the return says whether it did. P stays below e^LAZY_MAX (256) and O, P and
// the sums agree on m whatever it is; P is rounded to bf16 for its product with V, so the
// degree-3 2^x will do. halves: the vectors of rows in use (1: rows 16-31 are padding).
bool amx_softmax_step(float* st, float* pt, int n, int mask_k0, const vf* posv, float scale,
                      int halves, vf* mx, vf* sum, float* alpha) {
  if (mask_k0 >= 0) mask_past(st, n, mask_k0, posv, splat(-1e30f), halves);  // finite: vexp2_p's
  const vf c = splat(scale * 1.44269504088896341f);
  const vf lazy = splat(LAZY_MAX / scale);
  bool moved = false;
  for (int v = 0; v < halves; ++v) {
    const float* sp = st + v * VW;
    float* pp = pt + v * VW;
    vf step_max = splat(-INFINITY);
    // P against max m into pt, returning its sum; the step's max into step_max where asked.
    auto exponentiate = [&](vf m, bool find_max) {
      vf top[2] = {step_max, step_max}, part[2] = {splat(0.f), splat(0.f)};
      for (int j = 0; j < n; ++j) {
        const vf x = loadv(sp + j * ROWS);
        const vf e = vexp2_p((x - m) * c);
        storev(pp + j * ROWS, e);
        if (find_max) top[j & 1] = vmax(top[j & 1], x);
        part[j & 1] += e;
      }
      if (find_max) step_max = vmax(top[0], top[1]);
      return part[0] + part[1];
    };
    vf step_sum = exponentiate(mx[v], true);
    vf factor = splat(1.f);
    if (any_above(step_max, mx[v] + lazy)) {
      const vf m = vmax(mx[v], step_max);
      factor = vexp((mx[v] - m) * scale);  // 0 where m was -inf
      step_sum = exponentiate(m, false);
      mx[v] = m;
      moved = true;
    }
    sum[v] = sum[v] * factor + step_sum;
    storev(alpha + v * VW, factor);
  }
  return moved;
}
#endif

#if defined(PP_TILES)
#ifndef PP_VA_KEYS
#define PP_VA_KEYS 64
#endif
constexpr int VA_KEYS = PP_VA_KEYS;  // keys per softmax step when the vector path uses AMX (32 or 64)
constexpr int VA_CHUNKS = VA_KEYS / 32;

// V rows of keys [k0, k0 + n) (k0 a multiple of 16, n <= VA_KEYS) from their cache blocks,
// interleaved by pairs of keys into B tiles: vb[chunk of 32 keys][d / 16][16 key pairs][16 dims
// x 2 keys]; keys past n are zeros. Packed before the softmax, so that its stores have landed
// when the tiles load them.
void pack_v_pairs(const Args& a, const uint16_t* vc, const int32_t* table, int64_t head_base,
                  int k0, int n, uint16_t* vb) {
  const int d = a.head_dim;
  alignas(64) static constexpr uint16_t kPairs[32] = {0, 32, 1, 33, 2, 34, 3, 35, 4, 36, 5, 37,
                                                       6, 38, 7, 39, 8, 40, 9, 41, 10, 42, 11, 43,
                                                       12, 44, 13, 45, 14, 46, 15, 47};
  const __m512i pairs = _mm512_load_si512(kPairs);  // a's and b's 16-bit lanes in turn
  const int chunks = (n + 31) / 32;
  for (int i = 0; i < chunks * 16; ++i) {
    const int j = 2 * i, key = k0 + j;
    const uint16_t* va = j < n ? vc + (head_base + static_cast<int64_t>(table[key / a.block_size]) *
                                                       a.block_size + key % a.block_size) * d
                               : nullptr;
    uint16_t* dst = vb + (static_cast<size_t>(i / 16) * (d / 16) * 16 + i % 16) * 32;
    for (int x = 0; x < d / 16; ++x) {
      const __m512i ra = va ? _mm512_castsi256_si512(_mm256_loadu_si256(
                                  reinterpret_cast<const __m256i*>(va + x * 16)))
                            : _mm512_setzero_si512();
      const __m512i rb = j + 1 < n ? _mm512_castsi256_si512(_mm256_loadu_si256(
                                         reinterpret_cast<const __m256i*>(va + d + x * 16)))
                                   : _mm512_setzero_si512();
      _mm512_store_si512(dst + x * 16 * 32, _mm512_permutex2var_epi16(ra, pairs, rb));
    }
  }
}

// O[row][:] = O[row][:] * alpha[row] + P[row][keys] . V[keys][:] for the (up to) VA_KEYS keys
// whose P^T is st ([key][ROWS], S^T's exponentials) and whose V pairs pack_v_pairs packed into
// vb; O is [ROWS][head_dim] fp32 here (not O^T); alpha null: no rescale; halves 1: rows 0-15
// only (the rest, padding, left as they are). P is rounded to bf16
// and transposed into A tiles (16 rows x 32 keys); keys past n weigh 0. O makes one trip
// through the C tiles per call. Tiles: 1-2 P halves and 0 V of the first 32 keys, 5-6 and 7 of
// the next, 3-4 O halves.
void vector_amx_pv(int d, int n, float* st, const uint16_t* vb, const float* alpha, int halves,
                   float* o) {
  const int chunks = (n + 31) / 32;
  alignas(64) uint16_t pa[VA_CHUNKS][2 * 16 * 32];
  for (int j = n; j < chunks * 32; ++j)
    std::fill(st + static_cast<size_t>(j) * ROWS, st + static_cast<size_t>(j + 1) * ROWS, 0.f);
  for (int c = 0; c < chunks; ++c) {
    const float* sc = st + static_cast<size_t>(c) * 32 * ROWS;
    for (int h = 0; h < halves; ++h) {
      __m512i lo[16], hi[16];
      for (int j = 0; j < 16; ++j) {
        lo[j] = _mm512_loadu_si512(sc + static_cast<size_t>(j) * ROWS + h * 16);
        hi[j] = _mm512_loadu_si512(sc + static_cast<size_t>(j + 16) * ROWS + h * 16);
      }
      transpose16(lo);
      transpose16(hi);
      for (int r = 0; r < 16; ++r)
        _mm512_store_si512(pa[c] + (h * 16 + r) * 32,
                           reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(
                               _mm512_castsi512_ps(hi[r]), _mm512_castsi512_ps(lo[r]))));
    }
  }
  if (alpha != nullptr) {
    for (int r = 0; r < 16 * halves; ++r) {
      const __m512 f = _mm512_set1_ps(alpha[r]);
      for (int x = 0; x < d; x += 16)
        _mm512_storeu_ps(o + r * d + x, _mm512_mul_ps(_mm512_loadu_ps(o + r * d + x), f));
    }
  }
  const size_t chunk_elems = static_cast<size_t>(d / 16) * 16 * 32;
#if defined(PP_SOFT_TILES)
  // 8 rows x two 16-dim blocks of O at a time (d is a multiple of 32): 16 accumulators
  for (int r0 = 0; r0 < 16 * halves; r0 += 8) {
    for (int x = 0; x < d; x += 32) {
      __m512 lo[8], hi[8];
      for (int i = 0; i < 8; ++i) {
        lo[i] = _mm512_loadu_ps(o + (r0 + i) * d + x);
        hi[i] = _mm512_loadu_ps(o + (r0 + i) * d + x + 16);
      }
      for (int c = 0; c < chunks; ++c) {
        const uint16_t* b = vb + c * chunk_elems + (x / 16) * 16 * 32;
        soft_dp2(lo, hi, pa[c] + r0 * 32, 32, b, b + 16 * 32);
      }
      for (int i = 0; i < 8; ++i) {
        _mm512_storeu_ps(o + (r0 + i) * d + x, lo[i]);
        _mm512_storeu_ps(o + (r0 + i) * d + x + 16, hi[i]);
      }
    }
  }
#else
  const bool two = halves == 2;
  _tile_loadd(1, pa[0], 64);
  if (two) _tile_loadd(2, pa[0] + 16 * 32, 64);
  if (chunks > 1) {
    _tile_loadd(5, pa[1], 64);
    if (two) _tile_loadd(6, pa[1] + 16 * 32, 64);
  }
  for (int x = 0; x < d / 16; ++x) {
    _tile_loadd(3, o + x * 16, d * 4);
    if (two) _tile_loadd(4, o + 16 * d + x * 16, d * 4);
    _tile_loadd(0, vb + x * 16 * 32, 64);
    _tile_dpbf16ps(3, 1, 0);
    if (two) _tile_dpbf16ps(4, 2, 0);
    if (chunks > 1) {
      _tile_loadd(7, vb + chunk_elems + x * 16 * 32, 64);
      _tile_dpbf16ps(3, 5, 7);
      if (two) _tile_dpbf16ps(4, 6, 7);
    }
    _tile_stored(3, o + x * 16, d * 4);
    if (two) _tile_stored(4, o + 16 * d + x * 16, d * 4);
  }
#endif
}
#endif

template <typename T, typename C>
void attend_item(const Args& a, const Item& it, Scratch& s, Partials& partials) {
  const int d = a.head_dim;
  const int group = a.num_heads / a.num_kv_heads;
  const int start = a.start_pos[it.chunk];
  const int tok0 = a.query_starts[it.chunk];
  const int32_t* table = a.block_tables + static_cast<int64_t>(it.chunk) * a.max_blocks;
  const int64_t head_base = static_cast<int64_t>(it.kv_head) * a.num_blocks * a.block_size;
  const T* q = static_cast<const T*>(a.q);

  constexpr bool bf16 = std::is_same_v<T, uint16_t> && std::is_same_v<C, uint16_t>;
  const bool amx = bf16 && a.vector_amx;  // then O is [ROWS][d] here, not O^T [d][ROWS]
  // AMX products: an item of at most HALF_ROWS rows (a chunk of up to 5 tokens at a group of
  // 3, the last rows of a longer one) computes half of S^T, P and O: 1.2x on 5 tokens over
  // 7000 keys
  const int halves = it.rows > HALF_ROWS ? 2 : 1;
#if defined(PP_TILES)
  alignas(64) uint16_t qt[4 * 1024];  // Q^T B tiles, head_dim <= 128
  if (amx) pack_qt(a, it, it.row0, it.rows, qt);
#endif
  // Q^T [d][ROWS] (scaled: the fp32 products' operand), each row's position; padding rows see
  // every key with q = 0.
  if (!amx) std::fill(s.qt.begin(), s.qt.end(), 0.f);
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
    if (!amx)
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
#if defined(PP_TILES)
  const int key_step = amx ? VA_KEYS : BK;
  alignas(64) uint16_t vb[VA_CHUNKS * 8 * 16 * 32];  // V pairs, head_dim <= 128
  bool o_zero = true;                                 // O untouched yet: nothing to rescale
#else
  const int key_step = BK;
#endif
  for (int k0 = it.key_lo; k0 < kv_end; k0 += key_step) {
    const int n = std::min(key_step, kv_end - k0);
#if defined(PP_TILES)
    if constexpr (bf16) {
      if (amx) {
        vector_amx_scores(a, kc, table, head_base, k0, n, qt, halves, s.st.data());
        pack_v_pairs(a, vc, table, head_base, k0, n, vb);
      }
    }
#endif
    if (!amx) {
      key_rows(a, kc, table, head_base, k0, n, s.kbuf.data(), s.krow.data());
      scores_tile(s.qt.data(), s.krow.data(), n, d, s.st.data());
    }
    const bool causal = k0 + n - 1 > first_pos;  // the tile reaches past the first row
#if defined(PP_TILES)
    if constexpr (bf16) {
      if (amx) {
        alignas(64) float alpha_rows[ROWS];
        alignas(64) float pt[VA_KEYS * ROWS];
        const bool moved = amx_softmax_step(s.st.data(), pt, n, causal ? k0 : -1, posv, a.scale,
                                            halves, mx, sum, alpha_rows);
        vector_amx_pv(d, n, pt, vb, moved && !o_zero ? alpha_rows : nullptr, halves, s.ot.data());
        o_zero = false;
        continue;
      }
    }
#endif
    if (causal) mask_past(s.st.data(), n, k0, posv, splat(-INFINITY));
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
  auto o_at = [&](int x, int r) {  // O^T[x][r] in either layout
    return amx ? s.ot[static_cast<size_t>(r) * d + x] : s.ot[static_cast<size_t>(x) * ROWS + r];
  };
  if (it.part >= 0) {
    float* ot = partials.ot(it.part);  // O^T [d][ROWS]
    for (int x = 0; x < d; ++x)
      for (int r = 0; r < ROWS; ++r) ot[x * ROWS + r] = o_at(x, r);
    const vf mx_units = splat(amx ? a.scale : 1.f);  // the AMX path's max is in raw units
    for (int v = 0; v < MV; ++v) {
      storev(partials.mx(it.part) + v * VW, mx[v] * mx_units);
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
    for (int x = 0; x < d; ++x) store(dst + x, o_at(x, r) * inv[r]);
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
    if (a.amx_chunks != nullptr && a.amx_chunks[c]) continue;
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
  // At least four parts a thread; where items are split, a whole number of parts a thread
  // (the items of one short chunk over a long prefix are alike: three heads' items in three
  // parts each left one thread a fifth part to run alone; four each: 1.08x on 10 tokens over
  // 7000 keys).
  const int num_items = static_cast<int>(base.size());
  int want = (4 * num_threads + num_items - 1) / num_items;
  while (want > 1 && want < MAX_PARTS && want * num_items % num_threads != 0) ++want;
  int num_parts = 0;
  for (const Item& it : base) {
    const int start = a.start_pos[it.chunk];
    const int parts = std::min({want, start / SPLIT_MIN, MAX_PARTS});
    if (num_threads < 2 || parts < 2) {
      plan.items.push_back(it);
      continue;
    }
    const int span = start / parts / 16 * 16;  // parts start on 16-key tiles (AMX scores)
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
#if defined(PAGELLM_HAS_AMX)
    if (a.vector_amx) amx_load_config();
#endif
    Scratch scratch(a.head_dim);
#pragma omp for schedule(dynamic, 1)
    for (int i = 0; i < n; ++i) attend_item<T, C>(a, plan.items[i], scratch, partials);
#pragma omp for schedule(static)
    for (int i = 0; i < static_cast<int>(plan.splits.size()); ++i) {
      merge_split<T>(a, plan.whole[i], plan.splits[i].first, plan.splits[i].second, partials);
    }
#if defined(PAGELLM_HAS_AMX)
    if (a.vector_amx) _tile_release();
#endif
  }
}


#if defined(PAGELLM_HAS_AMX)
#include <immintrin.h>
// ----- AMX path: bf16 q and cache, head_dim a multiple of 32 ---------------------------------
// Scores are computed transposed, S^T = K Q^T, so that query rows lie along the vector lanes and
// the online softmax is lane-parallel (no horizontal reductions), as in the vector path above.
// Per (chunk, kv head) the keys the chunk sees are first packed, zeros past the last: K in A-tile
// form [key tile of 32][key half][head_dim / 32][16 keys][32 dims] and V^T in A-tile form
// [key tile][head_dim / 16][16 dims][32 keys]. A work item is 32 query rows (token, head of the
// group) of one kv head, with Q^T in B-tile form [head_dim / 32][row half][16 dim pairs][16
// rows][2]. Per key tile: S^T in four 16x16 fp32 tiles (TDPBF16PS over the head dims); the
// online softmax (causal mask where the tile reaches past a row's position); P^T rounded to bf16
// pairs of keys (B-tile form); O^T = O^T * alpha + V^T P^T, a head-dim half at a time. Tiles
// (amx_common.h): 0-3 C, 4-5 A (V^T), 6-7 B (P^T) for the products with V; ScoresPump's own for
// S^T. On a 2-core Xeon (one layer of SmolLM2's heads, a 2048-token chunk over 6144 cached keys)
// the scratch on cache-line boundaries (tile rows that straddle lines load ~4x slower), S^T
// computed during the previous unit's softmax and a softmax of fewer vector instructions
// (vexp2_p's reduction, the lazy check by the sums) took 29-31 -> 23-25 ms (1.2-1.3x).
constexpr int AT = 32;           // query rows per item, keys per tile
constexpr int TILE_ELEMS = 512;  // bf16 values in one 16 x 64-byte tile
// Key tiles per softmax step: O^T makes one trip between memory and the C tiles per step, and
// the step's bookkeeping (max check, rescale) is paid once for KS x 32 keys. On a 2-core Xeon
// (AMX) a 2048-token chunk over 6144 cached keys took 47 / 45 / 41 / 37 ms at 1 / 2 / 4 / 6
// tiles a step (8: no better).
#ifndef PP_AMX_STEP
#define PP_AMX_STEP 6
#endif
constexpr int KS = PP_AMX_STEP;
constexpr int KB = KS * AT;  // keys per softmax step

struct AmxPack {
  AlignedVector<uint16_t> k, vt;
  std::vector<int64_t> at;  // element offset of each (chunk, kv head)'s packed keys
  std::vector<int> tiles;   // key tiles of each (chunk, kv head)
};

// The keys chunk c sees (its prefix and itself) of kv head h, packed as above.
void amx_pack_one(const Args& a, int c, int h, int tiles, uint16_t* pk, uint16_t* pvt) {
  const int d = a.head_dim;
  const int kv_end = a.start_pos[c] + a.query_starts[c + 1] - a.query_starts[c];
  const int32_t* table = a.block_tables + static_cast<int64_t>(c) * a.max_blocks;
  const int64_t head_base = static_cast<int64_t>(h) * a.num_blocks * a.block_size;
  const uint16_t* kc = static_cast<const uint16_t*>(a.k_cache);
  const uint16_t* vc = static_cast<const uint16_t*>(a.v_cache);
  std::memset(pk, 0, static_cast<size_t>(tiles) * AT * d * 2);
  std::memset(pvt, 0, static_cast<size_t>(tiles) * AT * d * 2);
  const int dh_n = d / 32, dq_n = d / 16;
  for (int key = 0; key < kv_end; ++key) {
    const int64_t row = (head_base + static_cast<int64_t>(table[key / a.block_size]) * a.block_size +
                         key % a.block_size) * d;
    const int kt = key / AT, kh = (key % AT) / 16, kk = key % 16, j = key % AT;
    for (int dh = 0; dh < dh_n; ++dh) {
      uint16_t* dst = pk + ((static_cast<int64_t>(kt) * 2 + kh) * dh_n + dh) * TILE_ELEMS + kk * 32;
      std::memcpy(dst, kc + row + dh * 32, 64);
    }
    const uint16_t* v = vc + row;
    for (int dq = 0; dq < dq_n; ++dq) {
      uint16_t* dst = pvt + (static_cast<int64_t>(kt) * dq_n + dq) * TILE_ELEMS + j;
      for (int dd = 0; dd < 16; ++dd) dst[dd * 32] = v[dq * 16 + dd];
    }
  }
}

// One work item's state: SUB blocks of 32 rows, each with its Q^T, O^T and softmax rows.
constexpr int SUB = 4;  // a key tile read once from L2 serves 4 x 32 rows from L1

// A sub-block's key tiles of one softmax step: what the item's pipeline moves through.
struct Unit {
  int b, kt, nt;  // sub-block, first key tile, key tiles
  bool mask;      // whether some key is past some row's position
};

struct AmxScratch {
  AlignedVector<uint16_t> qt, pt;
  AlignedVector<float> ot, s, rows;  // s: two units' S^T; rows: pos, max, sum, alpha per sub-block
  std::vector<Unit> units;
  explicit AmxScratch(int d)
      : qt(static_cast<size_t>(SUB) * AT * d), pt(KB * AT), ot(static_cast<size_t>(SUB) * AT * d),
        s(2 * KB * AT), rows(static_cast<size_t>(SUB) * 4 * AT) {}
  float* pos(int b) { return rows.data() + b * 4 * AT; }
  float* mx(int b) { return pos(b) + AT; }
  float* sum(int b) { return pos(b) + 2 * AT; }
  float* alpha(int b) { return pos(b) + 3 * AT; }
};

inline void store_tiles(float* dst) {  // C tiles 0-3 as one 32 x 32 fp32 block
  _tile_stored(0, dst, AT * 4);
  _tile_stored(1, dst + 16, AT * 4);
  _tile_stored(2, dst + 16 * AT, AT * 4);
  _tile_stored(3, dst + 16 * AT + 16, AT * 4);
}

inline void load_tiles(const float* src) {  // the inverse of store_tiles
  _tile_loadd(0, src, AT * 4);
  _tile_loadd(1, src + 16, AT * 4);
  _tile_loadd(2, src + 16 * AT, AT * 4);
  _tile_loadd(3, src + 16 * AT + 16, AT * 4);
}

inline void dot_2x2() {  // C[2i + j] += A[i] B[j]
  _tile_dpbf16ps(0, 4, 6);
  _tile_dpbf16ps(1, 4, 7);
  _tile_dpbf16ps(2, 5, 6);
  _tile_dpbf16ps(3, 5, 7);
}

// Interleave two vectors of row values (keys 2kp and 2kp + 1) into bf16 pairs: VW pairs of a
// 64-byte B-tile row.
inline void pair_bf16(vf a, vf b, uint16_t* dst) {
#if defined(__AVX512BF16__)
  if constexpr (VW == 16) {
    __m512 va, vb;
    std::memcpy(&va, &a, 64);
    std::memcpy(&vb, &b, 64);
    const __m512i both = reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(vb, va));  // a.., b..
    alignas(64) static constexpr uint16_t order[32] = {
        0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23,
        8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31};
    _mm512_storeu_si512(dst, _mm512_permutexvar_epi16(_mm512_load_si512(order), both));
    return;
  }
#endif
  for (int l = 0; l < VW; ++l) store(dst + 2 * l, a[l]), store(dst + 2 * l + 1, b[l]);
}

constexpr float LAZY = 8.f;
constexpr float LAZY_SUM = 256.f;  // 2^LAZY
static_assert(KB < LAZY_SUM, "a step's keys at P <= 1 must sum under 2^LAZY");
constexpr float MASKED = -1e30f;  // a masked score: finite, so 2^(c * MASKED - max) is 0

// S^T of one unit (Q^T K, two C tiles per 16 keys), issued 16 keys a call, so that the
// previous unit's softmax (vector instructions) runs while the tiles compute: the AMX and
// vector units work side by side only where both kinds of instruction are near in program
// order. Tiles 0-1 C, 2-3 K and 4-7 Q^T (a head-dim slice's pair by turns, so that a load
// need not wait for the product reading the tile before).
class ScoresPump {
 public:
  ScoresPump() = default;
  ScoresPump(const uint16_t* pk, const uint16_t* qt, int dh_n, const Unit& u, float* s)
      : pk_(pk), qt_(qt), s_(s), dh_n_(dh_n), kt_(u.kt), pieces_(2 * u.nt) {}
  void operator()() {
    if (next_ < pieces_) issue(next_++);
  }
  void finish() {
    while (next_ < pieces_) issue(next_++);
  }

 private:
  // The tile intrinsics take their tile numbers as literals: one function per set.
  static void slice_even(const uint16_t* k, const uint16_t* q) {
    _tile_loadd(2, k, 64);
    _tile_loadd(4, q, 64);
    _tile_loadd(5, q + TILE_ELEMS, 64);
    _tile_dpbf16ps(0, 2, 4);
    _tile_dpbf16ps(1, 2, 5);
  }
  static void slice_odd(const uint16_t* k, const uint16_t* q) {
    _tile_loadd(3, k, 64);
    _tile_loadd(6, q, 64);
    _tile_loadd(7, q + TILE_ELEMS, 64);
    _tile_dpbf16ps(0, 3, 6);
    _tile_dpbf16ps(1, 3, 7);
  }
  void issue(int piece) {
    const int t = piece >> 1, kh = piece & 1;
    const uint16_t* k = pk_ + (static_cast<int64_t>(kt_ + t) * 2 + kh) * dh_n_ * TILE_ELEMS;
    _tile_zero(0);
    _tile_zero(1);
    for (int dh = 0; dh < dh_n_; dh += 2) {
      slice_even(k + dh * TILE_ELEMS, qt_ + dh * 2 * TILE_ELEMS);
      if (dh + 1 < dh_n_) slice_odd(k + (dh + 1) * TILE_ELEMS, qt_ + (dh + 1) * 2 * TILE_ELEMS);
    }
    float* dst = s_ + t * AT * AT + kh * 16 * AT;
    _tile_stored(0, dst, AT * 4);
    _tile_stored(1, dst + 16, AT * 4);
  }
  const uint16_t* pk_ = nullptr;
  const uint16_t* qt_ = nullptr;
  float* s_ = nullptr;
  int dh_n_ = 0, kt_ = 0, pieces_ = 0, next_ = 0;
};
constexpr int PUMP_KEYS = 32;  // softmax keys (of each row vector) between two pump calls

// The online softmax over S^T [keys][32 rows] (`keys` from k0, a multiple of 32, raw scores),
// lane-parallel over the rows, in base 2 (each row's max is kept as scale * log2(e) * score):
// P^T goes to sc.pt as bf16 B tiles (two per 32 keys, one per row half), each row's rescale
// factor to alpha; returns whether any row's max moved (else every alpha is 1).
template <typename Pump>
bool softmax_tile(const Args& a, const float* s, AmxScratch& sc, const float* pos, float* mx,
                  float* sum, float* alpha, int k0, int keys, bool mask, Pump& pump) {
  constexpr int NV = AT / VW;
  const float c = a.scale * 1.44269504088896341f;  // the scale is positive: max commutes
  bool moved = false;
  for (int v = 0; v < NV; ++v) {
    const vf posv = loadv(pos + v * VW);
    auto raw = [&](int j) {
      const vf x = loadv(s + j * AT + v * VW);
      return mask ? (splat(static_cast<float>(k0 + j)) > posv ? splat(MASKED) : x) : x;
    };
    const int lane0 = v * VW, rh = lane0 / 16, col = (lane0 % 16) * 2;
    uint16_t* pt = sc.pt.data() + rh * TILE_ELEMS + col;
    auto pair_at = [&](int j) {  // key pair (j, j + 1), j even, of B tile (j / 32, rh)
      return pt + (j / AT) * 2 * TILE_ELEMS + ((j % AT) / 2) * 32;
    };
    // One pass against the max kept so far: where no score passes it by more than LAZY (log2
    // units), every P = 2^(score - max) <= 2^LAZY and the row's sum of the step's P stays under
    // 2^LAZY too, as a row's max is exact (a score it saw) once it has moved: so the sum
    // tells, without a max taken over the scores (an instruction a vector of the pass, which is
    // bound by its vector instructions). Where a sum passes 2^LAZY (or on a row's first tile)
    // the tile is done again against the rows' exact max, with O^T rescaled.
    const vf old_max = loadv(mx + v * VW);
    bool first = false;
    for (int l = 0; l < VW; ++l) first |= old_max[l] == -INFINITY;
    if (!first) {
      vf total = splat(0.f);
      for (int j = 0; j < keys; j += 2) {
        if ((j & (PUMP_KEYS - 1)) == 0) pump();
        const vf e0 = vexp2_p(raw(j) * c - old_max), e1 = vexp2_p(raw(j + 1) * c - old_max);
        total += e0 + e1;
        pair_bf16(e0, e1, pair_at(j));
      }
      if (!any_above(total, splat(LAZY_SUM))) {
        storev(sum + v * VW, loadv(sum + v * VW) + total);
        storev(alpha + v * VW, splat(1.f));
        continue;
      }
    }
    vf tile_max = splat(-INFINITY);
    for (int j = 0; j < keys; ++j) tile_max = vmax(tile_max, raw(j));
    const vf new_max = vmax(old_max, tile_max * c);
    const vf al = vexp2(old_max - new_max);  // the first tile: 2^-inf = 0
    for (int l = 0; l < VW; ++l) moved |= new_max[l] != old_max[l];
    vf total = splat(0.f);
    for (int j = 0; j < keys; j += 2) {
      const vf e0 = vexp2_p(raw(j) * c - new_max), e1 = vexp2_p(raw(j + 1) * c - new_max);
      total += e0 + e1;
      pair_bf16(e0, e1, pair_at(j));
    }
    storev(sum + v * VW, loadv(sum + v * VW) * al + total);
    storev(mx + v * VW, new_max);
    storev(alpha + v * VW, al);
  }
  return moved;
}

// Rows [row0, row0 + rows) of an item as sub-block b (rows <= 32): Q^T packed, state reset.
void amx_sub_init(const Args& a, const Item& it, int b, AmxScratch& sc) {
  const int d = a.head_dim, group = a.num_heads / a.num_kv_heads;
  const int start = a.start_pos[it.chunk];
  const int row0 = it.row0 + b * AT, rows = std::min(AT, it.rows - b * AT);
  pack_qt(a, it, row0, rows, sc.qt.data() + static_cast<size_t>(b) * AT * d);
  std::fill(sc.ot.begin() + static_cast<size_t>(b) * AT * d,
            sc.ot.begin() + static_cast<size_t>(b + 1) * AT * d, 0.f);
  for (int r = 0; r < AT; ++r) {
    sc.mx(b)[r] = -INFINITY, sc.sum(b)[r] = 0.f;
    if (r >= rows) {
      sc.pos(b)[r] = 3.0e9f;  // padding rows see every key (their q is 0) and are dropped
      continue;
    }
    sc.pos(b)[r] = static_cast<float>(start + (row0 + r) / group);
  }
}

// O^T += V^T P^T for a unit whose softmax left P^T in sc.pt (after rescaling O^T by alpha
// where some row's max moved).
void pv_unit(const Args& a, const Unit& u, bool rescale, const uint16_t* pvt, AmxScratch& sc) {
  const int d = a.head_dim, dh_n = d / 32, dq_n = d / 16;
  const float* alpha = sc.alpha(u.b);
  float* ot = sc.ot.data() + static_cast<size_t>(u.b) * AT * d;  // O^T [dims][32 rows]
  if (rescale) {
    for (int x = 0; x < d; ++x)
      for (int v = 0; v < AT / VW; ++v)
        storev(ot + x * AT + v * VW, loadv(ot + x * AT + v * VW) * loadv(alpha + v * VW));
  }
  for (int dh = 0; dh < dh_n; ++dh) {  // O^T accumulates in the C tiles, a head-dim half a time
    load_tiles(ot + dh * 32 * AT);
    for (int t = 0; t < u.nt; ++t) {
      const int64_t k = u.kt + t;
      _tile_loadd(4, pvt + (k * dq_n + 2 * dh) * TILE_ELEMS, 64);
      _tile_loadd(5, pvt + (k * dq_n + 2 * dh + 1) * TILE_ELEMS, 64);
      _tile_loadd(6, sc.pt.data() + (t * 2) * TILE_ELEMS, 64);
      _tile_loadd(7, sc.pt.data() + (t * 2 + 1) * TILE_ELEMS, 64);
      dot_2x2();
    }
    store_tiles(ot + dh * 32 * AT);
  }
}

// An item: up to SUB x 32 rows of one (chunk, kv head), in units of KS key tiles per sub-block;
// each step's key tiles are used by every sub-block that sees them before the next are read.
// A unit's scores are computed while the one before it runs its softmax (two S^T buffers).
void amx_item(const Args& a, const Item& it, const uint16_t* pk, const uint16_t* pvt,
              AmxScratch& sc) {
  const int d = a.head_dim, group = a.num_heads / a.num_kv_heads, dh_n = d / 32;
  const int start = a.start_pos[it.chunk], tok0 = a.query_starts[it.chunk];
  const int subs = (it.rows + AT - 1) / AT;
  int first_pos[SUB], key_tiles[SUB];
  for (int b = 0; b < subs; ++b) {
    amx_sub_init(a, it, b, sc);
    const int row0 = it.row0 + b * AT, rows = std::min(AT, it.rows - b * AT);
    first_pos[b] = start + row0 / group;
    key_tiles[b] = (start + (row0 + rows - 1) / group + AT) / AT;  // ceil(kv_end / 32)
  }
  sc.units.clear();
  for (int kt = 0; kt < key_tiles[subs - 1]; kt += KS) {
    for (int b = 0; b < subs; ++b) {
      const int nt = std::min(KS, key_tiles[b] - kt);
      if (nt > 0) sc.units.push_back({b, kt, nt, (kt + nt) * AT - 1 > first_pos[b]});
    }
  }
  auto qt = [&](int b) { return sc.qt.data() + static_cast<size_t>(b) * AT * d; };
  float* s[2] = {sc.s.data(), sc.s.data() + KB * AT};
  const int n = static_cast<int>(sc.units.size());
  ScoresPump(pk, qt(sc.units[0].b), dh_n, sc.units[0], s[0]).finish();
  for (int i = 0; i < n; ++i) {
    const Unit& u = sc.units[i];
    ScoresPump next;
    if (i + 1 < n) {
      const Unit& after = sc.units[i + 1];
      next = ScoresPump(pk, qt(after.b), dh_n, after, s[(i + 1) & 1]);
    }
    const bool rescale = softmax_tile(a, s[i & 1], sc, sc.pos(u.b), sc.mx(u.b), sc.sum(u.b),
                                      sc.alpha(u.b), u.kt * AT, u.nt * AT, u.mask, next);
    next.finish();
    pv_unit(a, u, rescale, pvt, sc);
  }
  // O^T [dims][32 rows] back to rows, 16 rows x 16 dims a transpose, scaled by v_scale / sum
  uint16_t* out = static_cast<uint16_t*>(a.out);
  for (int b = 0; b < subs; ++b) {
    const float* ot = sc.ot.data() + static_cast<size_t>(b) * AT * d;
    const int rows = std::min(AT, it.rows - b * AT);
    for (int r0 = 0; r0 < rows; r0 += 16) {
      uint16_t* dst[16];
      float inv[16];
      for (int r = 0; r < std::min(16, rows - r0); ++r) {
        const int row = it.row0 + b * AT + r0 + r;
        dst[r] = out + (static_cast<int64_t>(tok0 + row / group) * a.num_heads +
                        it.kv_head * group + row % group) * d;
        inv[r] = a.v_scale / sc.sum(b)[r0 + r];
      }
      for (int x0 = 0; x0 < d; x0 += 16) {
        __m512i v[16];
        for (int j = 0; j < 16; ++j) v[j] = _mm512_loadu_si512(ot + (x0 + j) * AT + r0);
        transpose16(v);
        for (int r = 0; r < std::min(16, rows - r0); ++r)
          _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst[r] + x0),
                              reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(_mm512_mul_ps(
                                  _mm512_castsi512_ps(v[r]), _mm512_set1_ps(inv[r])))));
      }
    }
  }
}

// Which chunks the AMX path takes: all of a bf16 call with a plain cache and head_dim a
// multiple of 32, once the tile state is granted, but for chunks of fewer than AMX_MIN_ROWS
// query rows, which the vector path attends in place (the AMX path first packs every key the
// chunk sees, a cost a few rows do not repay: the cut chunks of a long prompt while others
// decode, a few tokens over thousands of cached ones). Returns how many chunks it takes.
constexpr int AMX_MIN_ROWS = 96;

int amx_chunk_mask(const Args& a, int dtype_code, int kv_code, int num_chunks,
                   std::vector<uint8_t>& mask) {
  if (dtype_code != 1 || kv_code != 0 || a.head_dim % 32 != 0 || a.head_dim > 256) return 0;
  const int group = a.num_heads / a.num_kv_heads;
  mask.assign(num_chunks, 0);
  int taken = 0;
  for (int c = 0; c < num_chunks; ++c) {
    mask[c] = (a.query_starts[c + 1] - a.query_starts[c]) * group >= AMX_MIN_ROWS;
    taken += mask[c];
  }
  return taken > 0 && amx_permitted() ? taken : 0;
}

void run_amx(const Args& a, int num_chunks, int num_threads) {
  const int group = a.num_heads / a.num_kv_heads, d = a.head_dim;
  AmxPack pack;
  std::vector<Item> items;
  int64_t total = 0;
  for (int c = 0; c < num_chunks; ++c) {
    const int tokens = a.amx_chunks[c] ? a.query_starts[c + 1] - a.query_starts[c] : 0;
    const int tiles = tokens ? (a.start_pos[c] + tokens + AT - 1) / AT : 0;
    for (int h = 0; h < a.num_kv_heads; ++h) {
      pack.at.push_back(total);
      pack.tiles.push_back(tiles);
      total += static_cast<int64_t>(tiles) * AT * d;
      for (int r0 = 0; r0 < tokens * group; r0 += SUB * AT) {
        const int n = std::min(SUB * AT, tokens * group - r0);
        const int64_t keys = a.start_pos[c] + (r0 + n - 1) / group + 1;
        items.push_back({c, h, r0, n, keys});
      }
    }
  }
  std::sort(items.begin(), items.end(), [](const Item& x, const Item& y) { return x.cost > y.cost; });
  pack.k.resize(total);
  pack.vt.resize(total);
  const int pairs = num_chunks * a.num_kv_heads;
  const int n = static_cast<int>(items.size());
  num_threads = std::max(1, std::min(num_threads, std::max(n, pairs)));
#pragma omp parallel num_threads(num_threads)
  {
#pragma omp for schedule(dynamic, 1)
    for (int i = 0; i < pairs; ++i) {
      if (pack.tiles[i] == 0) continue;
      amx_pack_one(a, i / a.num_kv_heads, i % a.num_kv_heads, pack.tiles[i],
                   pack.k.data() + pack.at[i], pack.vt.data() + pack.at[i]);
    }
    amx_load_config();
    AmxScratch scratch(d);
#pragma omp for schedule(dynamic, 1)
    for (int i = 0; i < n; ++i) {
      const Item& it = items[i];
      const int64_t at = pack.at[it.chunk * a.num_kv_heads + it.kv_head];
      amx_item(a, it, pack.k.data() + at, pack.vt.data() + at, scratch);
    }
    _tile_release();
  }
}
#endif

template <typename T>
int run_cache(int kv_code, const Args& a, int num_chunks, int num_threads) {
  switch (kv_code) {
    case 0: run<T, T>(a, num_chunks, num_threads); return 0;
    case 1: run<T, fp8_e4m3>(a, num_chunks, num_threads); return 0;
    case 2: run<T, fp8_e5m2>(a, num_chunks, num_threads); return 0;
    default: return 3;
  }
}

// Whether calls of these shapes run the vector path's two products on AMX tiles (bf16 q and
// cache, head_dim a multiple of 32 up to 128, blocks a multiple of 16).
bool vector_amx_applies(int dtype_code, int kv_code, int head_dim, int block_size,
                        int allow_amx) {
#if defined(PP_TILES)
#if defined(PAGELLM_HAS_AMX)
  const bool tiles = amx_permitted();
#else
  const bool tiles = true;  // soft tiles: nothing to ask for
#endif
  return PP_VECTOR_AMX && allow_amx && dtype_code == 1 && kv_code == 0 && ROWS == 32 &&
         head_dim % 32 == 0 && head_dim <= 128 && block_size % 16 == 0 && BK % 16 == 0 && tiles;
#else
  (void)dtype_code, (void)kv_code, (void)head_dim, (void)block_size, (void)allow_amx;
  return false;
#endif
}

}  // namespace

extern "C" int paged_prefill_attention(
    int dtype_code,  // q and out: 0 = float32, 1 = bfloat16
    int kv_code,     // the caches: 0 = as q, 1 = fp8 e4m3, 2 = fp8 e5m2
    const void* q, const void* k_cache, const void* v_cache, const int32_t* block_tables,
    const int32_t* query_starts, const int32_t* start_pos, void* out, int num_chunks,
    int num_heads, int num_kv_heads, int head_dim, int num_blocks, int block_size, int max_blocks,
    float scale, float v_scale, int num_threads, int allow_amx) {
  if (num_kv_heads <= 0 || num_heads % num_kv_heads != 0) return 1;
  Args a{q,         k_cache,      v_cache,  block_tables, query_starts, start_pos, out,
         num_heads, num_kv_heads, head_dim, num_blocks,   block_size,   max_blocks, scale,
         v_scale};
  a.vector_amx = vector_amx_applies(dtype_code, kv_code, head_dim, block_size, allow_amx);
#if defined(PAGELLM_HAS_AMX)
  std::vector<uint8_t> mask;
  const int on_amx = allow_amx ? amx_chunk_mask(a, dtype_code, kv_code, num_chunks, mask) : 0;
  if (on_amx > 0) {
    a.amx_chunks = mask.data();
    run_amx(a, num_chunks, std::max(1, num_threads));
    if (on_amx == num_chunks) return 0;
  }
#endif
  if (dtype_code == 0) return run_cache<float>(kv_code, a, num_chunks, num_threads);
  if (dtype_code == 1) return run_cache<uint16_t>(kv_code, a, num_chunks, num_threads);
  return 2;
}

extern "C" int paged_prefill_vector_width() { return VW; }

// Query rows (token x query head of a kv head's group) per work item of the vector path: a chunk
// of fewer rows costs as much as one of this many.
extern "C" int paged_prefill_item_rows() { return ROWS; }

// Query rows of the smallest work item for calls of these shapes (dtype and cache codes as
// paged_prefill_attention's): HALF_ROWS where the vector path's products run on AMX tiles (an
// item of so few rows computes half of them), else ROWS: fewer rows cost as much as this many.
extern "C" int paged_prefill_smallest_item_rows(int dtype_code, int kv_code, int head_dim,
                                                 int block_size, int allow_amx) {
  return vector_amx_applies(dtype_code, kv_code, head_dim, block_size, allow_amx) ? HALF_ROWS
                                                                                  : ROWS;
}

// How this build and process compute the bf16 products where tiles apply: 2 on AMX tiles, 1 as
// soft tiles (AVX-512 BF16 dot products), 0 in fp32 (the vector path's FMAs). 2 is also when
// bf16 chunks of many rows may take the AMX path.
extern "C" int paged_prefill_tile_products() {
#if defined(PP_SOFT_TILES)
  return 1;
#elif defined(PAGELLM_HAS_AMX)
  return amx_permitted() ? 2 : 0;
#else
  return 0;
#endif
}

// Entries for a captured step's list of calls (packed_call.h).
PAGELLM_PACKED(paged_prefill_attention)
