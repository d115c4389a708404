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
// The sums run where fewrow's isa() says: AVX-512 (attend_avx512.cpp), AVX2 + FMA (attend_avx2.cpp: 8 lanes,
// a key's lanes summed in one fixed tree, the same orders otherwise), or, for bf16 stores with head dim 64
// where the CPU has AMX, tile products (attend_amx.cpp): the same guarantees, other sums. 1 / 8 / 32 rows
// over 400 keys, one layer: 20 / 75 / 265 us on AVX-512, 20 / 34 / 94 us on AMX
// (scripts/probes/attend_cost.py, a 2-vCPU Xeon with AMX).
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

#include <algorithm>
#include <cstdint>
#include <type_traits>
#include <vector>

namespace {

using namespace mtplm::attend;

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
  const bool avx2 = mtplm::fewrow::avx2();
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
#if defined(__AVX512BF16__)
      if constexpr (std::is_same<T, uint16_t>::value) {
        if (tiles) {
          amx_task(h, query_rows, mask_rows, o, n, scratch.data());
          continue;
        }
      }
      if (!avx2) {
        avx512_task(h, query_rows, mask_rows, p, o, n);
        continue;
      }
#endif
      avx2_task(h, query_rows, mask_rows, p, o, n);
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
