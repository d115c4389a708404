// Attention of a decode pass's rows over the KV store (bf16 or float32), with sums that depend on nothing but
// the row and the keys it reads (mtplm/decode/fast/forward.py's attend calls it for both).
//
// A BLAS product sums by the shape it is handed: on some CPUs a row's scores and outputs round otherwise
// when 3 rows share the product than when 8 do, or when it reads 301 keys rather than 308. Verified decoding
// then drifts from plain decoding. Here every sum has one order, fixed by the row's own keys:
//   score_j = scaling * (q . k_j) + mask_j    one vdpbf16ps (float32: FMA) chain over d, then its lanes
//                                            summed in one fixed tree (16 keys at a time)
//   p_j     = exp(score_j - max)             max is exact; exp is this file's polynomial
//   out     = (sum_j p_j v_j) / (sum_j p_j)  both sums key by key, in key order
// Keys a row may not read (mask at float32's lowest) get p_j = 0 exactly and add +0 to both sums, so a row's
// output depends only on its query and the keys it reads, in their order: not on the key count a pass is
// bucketed to, the other rows of the pass, masked keys between the ones it reads (a draft tree's branch), or
// the threads.
//
// Where the CPU has AMX (and fewrow's isa() says "amx"), bf16 stores with head dim 64 take tile products
// instead (attend_amx.cpp): the same guarantees, other sums. 1 / 8 / 32 rows over 400 keys, one layer: 20 / 75 /
// 265 us here, 20 / 34 / 94 us there (scripts/attend_cost.py, a 2-vCPU Xeon with AMX).
//
// Shapes: query [b, Q, H, d] and stores [S, KVH, C, d] of one dtype (bf16 or float32), slots [b] long, mask
// [b, 1, 1, Q, T] float32 (additive), out [b, Q, H d] in the query's dtype; G = H / KVH query heads read KV
// head H / G (grouped-query attention). MKL's float32 products also round by the key count on an Intel Xeon
// (measured at 700 and 2000 keys), so float32 stores take this path too.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include "attend.h"
#include "fewrow.h"

#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>
#include <vector>

namespace {

using namespace mtplm::attend;

constexpr int kValueRows = 4;    // rows whose output accumulators share the registers in the value sum

// q . k_j's 16 lane partial sums over d elements (lane l: the elements at l, l + 16, ... in bf16 pairs
// for vdpbf16ps), one chain in a fixed order: vdpbf16ps on bf16 pairs, FMA in float32
inline __m512 partial_dot(const uint16_t* q, const uint16_t* k, int64_t d) {
  __m512 acc = _mm512_setzero_ps();
  for (int64_t e = 0; e < d; e += 32)
    acc = _mm512_dpbf16_ps(acc, (__m512bh)_mm512_loadu_si512(q + e), (__m512bh)_mm512_loadu_si512(k + e));
  return acc;
}
inline __m512 partial_dot(const float* q, const float* k, int64_t d) {
  __m512 acc = _mm512_setzero_ps();
  for (int64_t e = 0; e < d; e += 16) acc = _mm512_fmadd_ps(_mm512_loadu_ps(q + e), _mm512_loadu_ps(k + e), acc);
  return acc;
}

// The lane sums of 16 keys' partials, part[k] -> lane k, all in one tree that is the same for every key
// (lanes l + l+8, then + l+4, + l+2, + l+1): a key's score does not depend on its place in the block.
// Four levels of shuffles and adds for 16 keys instead of one horizontal reduction per key.
inline __m512 lane_sums(const __m512* part) {
  __m512 eight[8], four[4], two[2];
  for (int i = 0; i < 8; ++i)  // key 2i's lanes in blocks 0-1, key 2i+1's in blocks 2-3
    eight[i] = _mm512_add_ps(_mm512_shuffle_f32x4(part[2 * i], part[2 * i + 1], 0x44),
                             _mm512_shuffle_f32x4(part[2 * i], part[2 * i + 1], 0xEE));
  for (int i = 0; i < 4; ++i)  // block k: key 4i + k
    four[i] = _mm512_add_ps(_mm512_shuffle_f32x4(eight[2 * i], eight[2 * i + 1], 0x88),
                            _mm512_shuffle_f32x4(eight[2 * i], eight[2 * i + 1], 0xDD));
  for (int i = 0; i < 2; ++i)  // block k: keys 8i + k, 8i + 4 + k, two lanes each
    two[i] = _mm512_add_ps(_mm512_shuffle_ps(four[2 * i], four[2 * i + 1], 0x44),
                           _mm512_shuffle_ps(four[2 * i], four[2 * i + 1], 0xEE));
  const __m512 one = _mm512_add_ps(_mm512_shuffle_ps(two[0], two[1], 0x88),  // lane 4k + m: key 4m + k
                                   _mm512_shuffle_ps(two[0], two[1], 0xDD));
  return _mm512_permutexvar_ps(_mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15), one);
}

// For each of a task's rows r: p[r][j] = scaling * q_r . k_j + mask_r[j] for j < T, then exp(. - max) in
// place. 16 keys at a time, every row's partials of a key taken while the key sits in L1 (keys past T:
// zeros, their lanes unused); a row's scores are the same whichever rows share the task.
template <typename T>
void probabilities(const Head<T>& h, const T* const* q, const float* const* mask, float* const* p, int rows) {
  alignas(64) float part[kRowsPerTask][16][16];
  const __m512 scaling = _mm512_set1_ps(h.scaling);
  __m512 top[kRowsPerTask];
  for (int r = 0; r < rows; ++r) top[r] = _mm512_set1_ps(-__FLT_MAX__);
  for (int64_t j = 0; j < h.t; j += 16) {
    const int64_t n = std::min<int64_t>(16, h.t - j);
    for (int k = 0; k < 16; ++k) {
      const T* key = h.keys + (j + k) * h.d;
      ahead(key + kPrefetchKeys * h.d, h.d);
      for (int r = 0; r < rows; ++r)
        _mm512_store_ps(part[r][k], k < n ? partial_dot(q[r], key, h.d) : _mm512_setzero_ps());
    }
    const __mmask16 in = lanes(n);
    for (int r = 0; r < rows; ++r) {
      __m512 sums[16];
      for (int k = 0; k < 16; ++k) sums[k] = _mm512_load_ps(part[r][k]);
      const __m512 x = _mm512_add_ps(_mm512_mul_ps(lane_sums(sums), scaling), _mm512_maskz_loadu_ps(in, mask[r] + j));
      _mm512_mask_storeu_ps(p[r] + j, in, x);
      top[r] = _mm512_mask_max_ps(top[r], in, top[r], x);
    }
  }
  for (int r = 0; r < rows; ++r) {
    const __m512 high = _mm512_set1_ps(_mm512_reduce_max_ps(top[r]));
    for (int64_t j = 0; j < h.t; j += 16) {
      const __mmask16 in = lanes(h.t - j);
      const __m512 x = _mm512_sub_ps(_mm512_maskz_loadu_ps(in, p[r] + j), high);
      _mm512_mask_storeu_ps(p[r] + j, in, exp_nonpositive(x));
    }
  }
}

// out[r] = sum_j p[r][j] v_j / sum_j p[r][j] for R rows (C = d / 16 float32 chunks), keys in order.
template <int R, int C, typename T>
void weighted_values(const Head<T>& h, float* const* p, T* const* out) {
  __m512 acc[R][C], total[R];  // every lane of total[r] holds the same running sum
  for (int r = 0; r < R; ++r) {
    total[r] = _mm512_setzero_ps();
    for (int c = 0; c < C; ++c) acc[r][c] = _mm512_setzero_ps();
  }
  for (int64_t j = 0; j < h.t; ++j) {
    const T* v = h.values + j * h.d;
    ahead(v + kPrefetchKeys * h.d, h.d);
    __m512 row[C];
    for (int c = 0; c < C; ++c) row[c] = load16(v + 16 * c);
    for (int r = 0; r < R; ++r) {
      const __m512 weight = _mm512_set1_ps(p[r][j]);
      total[r] = _mm512_add_ps(total[r], weight);
      for (int c = 0; c < C; ++c) acc[r][c] = _mm512_fmadd_ps(weight, row[c], acc[r][c]);
    }
  }
  for (int r = 0; r < R; ++r) {
    const __m512 scale = _mm512_div_ps(_mm512_set1_ps(1.0f), total[r]);
    for (int c = 0; c < C; ++c) store16(out[r] + 16 * c, _mm512_mul_ps(acc[r][c], scale));
  }
}

template <int C, typename T>
void values_in_groups(const Head<T>& h, float* const* p, T* const* out, int rows) {
  int r = 0;
  for (; r + kValueRows <= rows; r += kValueRows) weighted_values<kValueRows, C>(h, p + r, out + r);
  for (; r < rows; ++r) weighted_values<1, C>(h, p + r, out + r);
}

// The pass over element type T (uint16_t for bf16, float): parallel tasks of up to kRowsPerTask query rows of
// one sequence's KV head.
template <typename T>
void attend_rows(const at::Tensor& query, const at::Tensor& key_store, const at::Tensor& value_store,
                 const at::Tensor& slots, const at::Tensor& mask, double scaling, at::Tensor& out) {
  const int64_t b = query.size(0), q = query.size(1), heads = query.size(2), d = query.size(3);
  const int64_t kv_heads = key_store.size(1), capacity = key_store.size(2), t = mask.size(4);
  const int64_t groups = heads / kv_heads, rows = groups * q;
  const int64_t chunks = (rows + kRowsPerTask - 1) / kRowsPerTask;  // tasks per (sequence, KV head): each reads K, V
  const int64_t span = (rows + chunks - 1) / chunks;  // rows per task, as even as they go
  const auto* qs = reinterpret_cast<const T*>(query.data_ptr());
  const auto* ks = reinterpret_cast<const T*>(key_store.data_ptr());
  const auto* vs = reinterpret_cast<const T*>(value_store.data_ptr());
  auto* os = reinterpret_cast<T*>(out.data_ptr());
  const float* ms = mask.data_ptr<float>();
  const int64_t* ss = slots.data_ptr<int64_t>();
  // the few-row products' ISA choice (MTPLM_FEWROW_ISA) serves attention too
  const bool tiles = std::is_same<T, uint16_t>::value && d == 64 && mtplm::fewrow::amx();
  at::parallel_for(0, b * kv_heads * chunks, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scratch(tiles ? 16 * (t + 32) : span * t);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t i = task / (kv_heads * chunks), kvh = task / chunks % kv_heads, first = task % chunks * span;
      const int64_t store = (ss[i] * kv_heads + kvh) * capacity * d;
      const float* masks = ms + i * q * t;
      const int n = int(std::min<int64_t>(span, rows - first));  // >= 1: chunks * span - rows < span
      float* p[kRowsPerTask];
      const T* query_rows[kRowsPerTask];
      const float* mask_rows[kRowsPerTask];
      T* o[kRowsPerTask];
      int64_t reach = 0;  // keys up to the last one any of these rows reads
      for (int r = 0; r < n; ++r) {  // row (g, fed row) of this KV head: query head kvh * G + g
        const int64_t g = (first + r) / q, row = (first + r) % q, head = kvh * groups + g;
        p[r] = scratch.data() + r * t;
        query_rows[r] = qs + ((i * q + row) * heads + head) * d;
        mask_rows[r] = masks + row * t;
        o[r] = os + ((i * q + row) * heads + head) * d;
        reach = std::max(reach, readable(mask_rows[r], t));
      }
      const Head<T> h{ks + store, vs + store, reach, d, float(scaling)};
      if constexpr (std::is_same<T, uint16_t>::value) {
        if (tiles) {
          amx_task(h, query_rows, mask_rows, o, n, scratch.data());
          continue;
        }
      }
      probabilities(h, query_rows, mask_rows, p, n);
      d == 64 ? values_in_groups<4>(h, p, o, n) : values_in_groups<8>(h, p, o, n);
    }
  });
}

at::Tensor attend(const at::Tensor& query, const at::Tensor& key_store, const at::Tensor& value_store,
                  const at::Tensor& slots, const at::Tensor& mask, double scaling) {
  TORCH_CHECK(query.dim() == 4 && key_store.dim() == 4 && value_store.sizes() == key_store.sizes() &&
                  slots.dim() == 1 && mask.dim() == 5,
              "mtplm attend: query [b, Q, H, d], stores [S, KVH, C, d], slots [b], mask [b, 1, 1, Q, T]");
  const auto dtype = query.scalar_type();
  TORCH_CHECK((dtype == at::kBFloat16 || dtype == at::kFloat) && key_store.scalar_type() == dtype &&
                  value_store.scalar_type() == dtype && mask.scalar_type() == at::kFloat &&
                  slots.scalar_type() == at::kLong,
              "mtplm attend: query and stores both bf16 or both float32, float32 mask, long slots");
  const int64_t b = query.size(0), q = query.size(1), heads = query.size(2), d = query.size(3);
  const int64_t kv_heads = key_store.size(1), t = mask.size(4);
  TORCH_CHECK(d == 64 || d == 128, "mtplm attend: head dim 64 or 128, not ", d);
  TORCH_CHECK(heads % kv_heads == 0 && key_store.size(3) == d && slots.size(0) == b && t <= key_store.size(2) &&
                  mask.size(0) == b && mask.size(3) == q,
              "mtplm attend: shapes do not agree");
  TORCH_CHECK(key_store.is_contiguous() && value_store.is_contiguous(), "mtplm attend: contiguous stores");
  const at::Tensor x = query.contiguous(), m = mask.contiguous(), s = slots.contiguous();
  at::Tensor out = at::empty({b, q, heads * d}, query.options());
  if (dtype == at::kFloat)
    attend_rows<float>(x, key_store, value_store, s, m, scaling, out);
  else
    attend_rows<uint16_t>(x, key_store, value_store, s, m, scaling, out);
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(mtplm_fewrow, m) {
  m.def("attend(Tensor query, Tensor key_store, Tensor value_store, Tensor slots, Tensor mask, float scaling) -> Tensor");
}

TORCH_LIBRARY_IMPL(mtplm_fewrow, CPU, m) { m.impl("attend", attend); }
