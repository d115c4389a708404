// Attention of a decode pass's rows over the bf16 KV store, with sums that depend on nothing but the row and
// the keys it reads (mtplm/decode/fast/forward.py's attend calls it for bf16 stores).
//
// A BLAS product sums by the shape it is handed: on some CPUs a row's scores and outputs round otherwise
// when 3 rows share the product than when 8 do, or when it reads 301 keys rather than 308. Verified decoding
// then drifts from plain decoding. Here every sum has one order, fixed by the row's own keys:
//   score_j = scaling * (q . k_j) + mask_j    one vdpbf16ps chain over d, then a fixed horizontal sum
//   p_j     = exp(score_j - max)             max is exact; exp is this file's polynomial
//   out     = (sum_j p_j v_j) / (sum_j p_j)  both sums key by key, in key order
// Keys a row may not read (mask at float32's lowest) get p_j = 0 exactly and add +0 to both sums, so a row's
// output depends only on its query and the keys it reads, in their order: not on the key count a pass is
// bucketed to, the other rows of the pass, masked keys between the ones it reads (a draft tree's branch), or
// the threads.
//
// Shapes: query [b, Q, H, d] bf16, stores [S, KVH, C, d] bf16, slots [b] long, mask [b, 1, 1, Q, T] float32
// (additive), out [b, Q, H d] bf16; G = H / KVH query heads read KV head H / G (grouped-query attention).

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <vector>

namespace {

constexpr int kRowsPerTask = 8;  // query rows of one KV head per parallel task
constexpr int kValueRows = 4;    // rows whose output accumulators share the registers in the value sum

inline __m512 widen(__m256i half) {  // 16 bf16 -> float32
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(half), 16));
}

// e^x for x <= 0 in float32 (|relative error| ~1e-7); 0 below -87 (where float32 would go subnormal).
inline __m512 exp_nonpositive(__m512 x) {
  const __mmask16 live = _mm512_cmp_ps_mask(x, _mm512_set1_ps(-87.0f), _CMP_GE_OQ);
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504f)), _MM_FROUND_TO_NEAREST_INT);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);  // x - n ln2, ln2 in two parts
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.0f / 720);  // Taylor to r^6 on |r| <= ln2 / 2
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 120));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 24));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 6));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  return _mm512_maskz_scalef_ps(live, p, n);
}

inline __mmask16 lanes(int64_t count) { return count >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << count) - 1); }

struct Head {  // one sequence's KV head and the mask rows of its pass
  const uint16_t* keys;    // [C, d]
  const uint16_t* values;  // [C, d]
  const float* mask;       // [Q, T]
  int64_t t, d;
  float scaling;
};

// scores[j] = scaling * q . k_j + mask[j] for j < T, then p_j = exp(scores[j] - max) in place.
void probabilities(const Head& h, const uint16_t* q, const float* mask, float* scores) {
  __m512 top = _mm512_set1_ps(-__FLT_MAX__);
  for (int64_t j = 0; j < h.t; ++j) {
    const uint16_t* k = h.keys + j * h.d;
    __m512 acc = _mm512_setzero_ps();
    for (int64_t e = 0; e < h.d; e += 32)
      acc = _mm512_dpbf16_ps(acc, (__m512bh)_mm512_loadu_si512(q + e), (__m512bh)_mm512_loadu_si512(k + e));
    scores[j] = _mm512_reduce_add_ps(acc) * h.scaling + mask[j];
  }
  for (int64_t j = 0; j < h.t; j += 16) {
    const __mmask16 in = lanes(h.t - j);
    top = _mm512_mask_max_ps(top, in, top, _mm512_maskz_loadu_ps(in, scores + j));
  }
  const __m512 high = _mm512_set1_ps(_mm512_reduce_max_ps(top));
  for (int64_t j = 0; j < h.t; j += 16) {
    const __mmask16 in = lanes(h.t - j);
    const __m512 x = _mm512_sub_ps(_mm512_maskz_loadu_ps(in, scores + j), high);
    _mm512_mask_storeu_ps(scores + j, in, exp_nonpositive(x));
  }
}

// out[r] = sum_j p[r][j] v_j / sum_j p[r][j] for R rows (C = d / 16 float32 chunks), keys in order.
template <int R, int C>
void weighted_values(const Head& h, float* const* p, uint16_t* const* out) {
  __m512 acc[R][C], total[R];  // every lane of total[r] holds the same running sum
  for (int r = 0; r < R; ++r) {
    total[r] = _mm512_setzero_ps();
    for (int c = 0; c < C; ++c) acc[r][c] = _mm512_setzero_ps();
  }
  for (int64_t j = 0; j < h.t; ++j) {
    const uint16_t* v = h.values + j * h.d;
    __m512 row[C];
    for (int c = 0; c < C; ++c) row[c] = widen(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(v + 16 * c)));
    for (int r = 0; r < R; ++r) {
      const __m512 weight = _mm512_set1_ps(p[r][j]);
      total[r] = _mm512_add_ps(total[r], weight);
      for (int c = 0; c < C; ++c) acc[r][c] = _mm512_fmadd_ps(weight, row[c], acc[r][c]);
    }
  }
  for (int r = 0; r < R; ++r) {
    const __m512 scale = _mm512_div_ps(_mm512_set1_ps(1.0f), total[r]);
    for (int c = 0; c < C; ++c)
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(out[r] + 16 * c),
                          (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(acc[r][c], scale)));
  }
}

template <int C>
void values_in_groups(const Head& h, float* const* p, uint16_t* const* out, int rows) {
  int r = 0;
  for (; r + kValueRows <= rows; r += kValueRows) weighted_values<kValueRows, C>(h, p + r, out + r);
  for (; r < rows; ++r) weighted_values<1, C>(h, p + r, out + r);
}

at::Tensor attend(const at::Tensor& query, const at::Tensor& key_store, const at::Tensor& value_store,
                  const at::Tensor& slots, const at::Tensor& mask, double scaling) {
  TORCH_CHECK(query.dim() == 4 && key_store.dim() == 4 && value_store.sizes() == key_store.sizes() &&
                  slots.dim() == 1 && mask.dim() == 5,
              "mtplm attend: query [b, Q, H, d], stores [S, KVH, C, d], slots [b], mask [b, 1, 1, Q, T]");
  TORCH_CHECK(query.scalar_type() == at::kBFloat16 && key_store.scalar_type() == at::kBFloat16 &&
                  value_store.scalar_type() == at::kBFloat16 && mask.scalar_type() == at::kFloat &&
                  slots.scalar_type() == at::kLong,
              "mtplm attend: bf16 query and stores, float32 mask, long slots");
  const int64_t b = query.size(0), q = query.size(1), heads = query.size(2), d = query.size(3);
  const int64_t kv_heads = key_store.size(1), capacity = key_store.size(2), t = mask.size(4);
  TORCH_CHECK(d == 64 || d == 128, "mtplm attend: head dim 64 or 128, not ", d);
  TORCH_CHECK(heads % kv_heads == 0 && key_store.size(3) == d && slots.size(0) == b && t <= capacity &&
                  mask.size(0) == b && mask.size(3) == q,
              "mtplm attend: shapes do not agree");
  TORCH_CHECK(key_store.is_contiguous() && value_store.is_contiguous(), "mtplm attend: contiguous stores");
  const at::Tensor x = query.contiguous(), m = mask.contiguous(), s = slots.contiguous();
  at::Tensor out = at::empty({b, q, heads * d}, query.options());
  const int64_t groups = heads / kv_heads, rows = groups * q, chunks = (rows + kRowsPerTask - 1) / kRowsPerTask;
  const auto* qs = reinterpret_cast<const uint16_t*>(x.data_ptr());
  const auto* ks = reinterpret_cast<const uint16_t*>(key_store.data_ptr());
  const auto* vs = reinterpret_cast<const uint16_t*>(value_store.data_ptr());
  auto* os = reinterpret_cast<uint16_t*>(out.data_ptr());
  const float* ms = m.data_ptr<float>();
  const int64_t* ss = s.data_ptr<int64_t>();
  at::parallel_for(0, b * kv_heads * chunks, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scratch(kRowsPerTask * t);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t i = task / (kv_heads * chunks), kvh = task / chunks % kv_heads, first = task % chunks * kRowsPerTask;
      const int64_t store = (ss[i] * kv_heads + kvh) * capacity * d;
      const Head h{ks + store, vs + store, ms + i * q * t, t, d, float(scaling)};
      const int n = int(std::min<int64_t>(kRowsPerTask, rows - first));
      float* p[kRowsPerTask];
      uint16_t* o[kRowsPerTask];
      for (int r = 0; r < n; ++r) {  // row (g, fed row) of this KV head: query head kvh * G + g
        const int64_t g = (first + r) / q, row = (first + r) % q, head = kvh * groups + g;
        p[r] = scratch.data() + r * t;
        probabilities(h, qs + ((i * q + row) * heads + head) * d, h.mask + row * t, p[r]);
        o[r] = os + ((i * q + row) * heads + head) * d;
      }
      d == 64 ? values_in_groups<4>(h, p, o, n) : values_in_groups<8>(h, p, o, n);
    }
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(mtplm_fewrow, m) {
  m.def("attend(Tensor query, Tensor key_store, Tensor value_store, Tensor slots, Tensor mask, float scaling) -> Tensor");
}

TORCH_LIBRARY_IMPL(mtplm_fewrow, CPU, m) { m.impl("attend", attend); }
