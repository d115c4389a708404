// Greedy tokens from the LM head at about half of its weight traffic, bitwise the argmax of its logits
// (mtplm/decode/fast/greedy.py holds the int8 copy and calls this).
//
// Greedy decoding needs each row's argmax, yet the head's bf16 weights W [V, D] (57 MB for SmolLM2) are read
// whole every pass. This op reads an int8 copy (codes q_t, one scale s_t per token) and bounds the logit the
// bf16 kernel (fewrow.cpp) computes for every token:
//
//   the row in two int8 levels: h ~ s1 q1 + s2 q2 (s2 = s1 / 254: about 15 bits; one int8 level would make
//   the bound thousands of times wider, a hidden state's few outlying features being ~100x the rest)
//   approx_t = s_t (s1 q1 . q_t + s2 q2 . q_t)      the dots exact in int32
//   |h . W_t - approx_t| <= |h|_1 r_t + e_h a_t      r_t = max_k |W_tk - s_t q_tk|, a_t = s_t |q_t|_1,
//                                                    e_h = max_k |h_k - s1 q1_k - s2 q2_k|
//   plus float32 rounding: the kernel's own sums (D 2^-22 |h|_1 max_k |W_tk|) and a relative 2^-20.
//
// A token whose upper bound falls short of the row's best lower bound (less the bf16 output's rounding) is
// not the argmax. The few that remain (a median of 4 a row on SmolLM2, int16 row) are computed again by the
// bf16 kernel over their 16-token blocks of the packed head: a logit does not depend on the other rows or
// outputs of the product, so the token chosen is the full head's argmax (its first maximal index) exactly.
//
// Codes are packed [Vp / 16][Dp / 4][16][4] int8 (Dp a multiple of 64): 64 contiguous bytes per quad of
// inputs of a 16-token block, which is AMX's int8 B-tile layout. Without AMX, the row is one int16 level and
// each 64-byte group is widened and added two pairs at a time: vpdpwssd on AVX-512 VNNI (head_avx512.cpp,
// with the AMX tiles), vpmaddwd on AVX2 (head_avx2.cpp). The dots are exact integers either way.

#include "fewrow.h"
#include "head.h"

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/full.h>
#include <torch/library.h>

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <string>
#include <vector>

namespace {

using mtplm::head::Head;
using mtplm::head::kBlock;
using mtplm::head::kMaxRows;
using mtplm::head::Rows;
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

inline float clamped(float x, float limit) { return std::min(limit, std::max(-limit, std::nearbyint(x))); }

Rows quantize(const at::Tensor& hidden, int64_t dp, bool amx) {
  const int64_t n = hidden.size(0), d = hidden.size(1);
  const auto* h = reinterpret_cast<const c10::BFloat16*>(hidden.data_ptr());
  Rows rows{};
  rows.n = n, rows.dp = dp;
  rows.high.assign(amx ? n * dp : 0, 0), rows.low.assign(amx ? n * dp : 0, 0);
  rows.wide.assign(amx ? 0 : n * dp, 0);
  const float limit = float(std::min<int64_t>(16383, (int64_t(1) << 31) / (dp * 127 + 1) - 1));
  for (int64_t r = 0; r < n; ++r) {
    float top = 0.f, l1 = 0.f;
    for (int64_t k = 0; k < d; ++k) {
      const float x = float(h[r * d + k]);
      top = std::max(top, std::fabs(x)), l1 += std::fabs(x);
    }
    const float s1 = top > 0.f ? top / (amx ? 127.f : limit) : 1.f, s2 = amx ? s1 / 254.f : 0.f;
    float residual = 0.f;
    for (int64_t k = 0; k < d; ++k) {
      const float x = float(h[r * d + k]);
      if (amx) {
        const float q1 = clamped(x / s1, 127.f), q2 = clamped((x - q1 * s1) / s2, 127.f);
        rows.high[r * dp + k] = int8_t(q1), rows.low[r * dp + k] = int8_t(q2);
        residual = std::max(residual, std::fabs(x - q1 * s1 - q2 * s2));
      } else {
        const float q = clamped(x / s1, limit);
        rows.wide[r * dp + k] = int16_t(q);
        residual = std::max(residual, std::fabs(x - q * s1));
      }
    }
    // float32 rounding in these checks: e_h may come out a few ulps of the row's largest |h_k| short
    // (x - q1 s1 - q2 s2), and a float32 sum of D terms up to D 2^-24 of itself
    rows.s1[r] = s1, rows.s2[r] = s2, rows.residual[r] = residual * 1.001f + top * 0x1p-21f;
    rows.l1[r] = l1 * (1.f + float(d) * 0x1p-23f);
  }
  return rows;
}

at::Tensor fewrow_linear(const at::Tensor& x, const at::Tensor& packed) {
  static const auto op = c10::Dispatcher::singleton()
                             .findSchemaOrThrow("mtplm_fewrow::linear", "")
                             .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>&)>();
  return op.call(x, packed, std::nullopt);
}

// Each row's candidates (upper bound >= its threshold), 8 bounds a compare.
__attribute__((target("avx2"))) std::vector<std::vector<int64_t>> candidates(const float* upper,
                                                                             const float* threshold, int64_t n,
                                                                             int64_t vp) {
  std::vector<std::vector<int64_t>> found(n);
  for (int64_t r = 0; r < n; ++r) {
    const __m256 cut = _mm256_set1_ps(threshold[r]);
    for (int64_t t = 0; t < vp; t += 8) {
      unsigned hits = unsigned(_mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(upper + r * vp + t), cut, _CMP_GE_OQ)));
      for (; hits != 0; hits &= hits - 1) found[r].push_back(t + __builtin_ctz(hits));
    }
  }
  return found;
}

// The candidates' blocks' bf16 logits by the full head's kernel, and each row's first maximal candidate.
at::Tensor exact_argmax(const at::Tensor& hidden, const at::Tensor& packed,
                        const std::vector<std::vector<int64_t>>& found, int64_t vp) {
  const int64_t n = hidden.size(0), kp = packed.size(2);
  std::vector<int64_t> slot(vp / kBlock, -1), chosen;  // block -> its place among the gathered blocks
  for (const auto& row : found)
    for (int64_t t : row)
      if (slot[t / kBlock] < 0) slot[t / kBlock] = int64_t(chosen.size()), chosen.push_back(t / kBlock);
  const int64_t count = int64_t(chosen.size());
  at::Tensor gathered = at::empty({count * kBlock * kp}, packed.options());
  const auto* from = reinterpret_cast<const uint16_t*>(packed.data_ptr());
  auto* to = reinterpret_cast<uint16_t*>(gathered.data_ptr());
  for (int64_t i = 0; i < count; ++i)
    std::memcpy(to + i * kBlock * kp, from + chosen[i] * kBlock * kp, kBlock * kp * sizeof(uint16_t));
  const at::Tensor logits = fewrow_linear(hidden, gathered.as_strided({count * kBlock, 1, kp}, {kp, kp, 1}));
  const auto* y = reinterpret_cast<const c10::BFloat16*>(logits.data_ptr());
  at::Tensor out = at::empty({n}, hidden.options().dtype(at::kLong));
  int64_t* tokens = out.data_ptr<int64_t>();
  for (int64_t r = 0; r < n; ++r) {
    float best = kNegInf;
    int64_t token = -1;
    for (int64_t t : found[r]) {  // ascending: the first of equal maxima wins, as argmax(-1)
      const float value = float(y[r * count * kBlock + slot[t / kBlock] * kBlock + t % kBlock]);
      if (token < 0 || value > best) best = value, token = t;
    }
    tokens[r] = token;
  }
  return out;
}

// hidden [N <= 16, D] bf16; codes [Vp, 1, Dp] int8 (the packed layout); stats [4, Vp] float32 (s_t, r_t, a_t,
// 127 s_t + r_t); packed: the head's bf16 weight in fewrow's layout; v real tokens; mask_id never chosen
// (-1: none). -> token ids [N]; -1 for a row whose bounds are not finite (the caller asks the full head).
at::Tensor head_argmax(const at::Tensor& hidden, const at::Tensor& codes, const at::Tensor& stats,
                       const at::Tensor& packed, int64_t v, int64_t mask_id) {
  TORCH_CHECK(hidden.dim() == 2 && hidden.scalar_type() == at::kBFloat16 && hidden.size(0) <= kMaxRows &&
                  hidden.size(0) > 0,
              "head_argmax: hidden [1..16, D] bf16");
  TORCH_CHECK(codes.dim() == 3 && codes.scalar_type() == at::kChar && codes.size(2) % 64 == 0 &&
                  codes.size(2) >= hidden.size(1) && codes.size(0) % kBlock == 0 && codes.size(0) >= v,
              "head_argmax: codes [Vp, 1, Dp] int8, Vp a multiple of 16, Dp of 64");
  TORCH_CHECK(stats.dim() == 2 && stats.size(0) == 4 && stats.size(1) == codes.size(0) &&
                  stats.scalar_type() == at::kFloat && stats.is_contiguous(),
              "head_argmax: stats [4, Vp] float32");
  TORCH_CHECK(packed.dim() == 3 && packed.scalar_type() == at::kBFloat16 && packed.size(0) == v,
              "head_argmax: packed [V, 1, Kp] bf16");
  const at::Tensor h = hidden.contiguous();
  const int64_t n = h.size(0), vp = codes.size(0), dp = codes.size(2);
  const bool amx = mtplm::fewrow::amx();
  const Rows x = quantize(h, dp, amx);
  const float* s = stats.data_ptr<float>();
  const Head hd{reinterpret_cast<const int8_t*>(codes.data_ptr()), s, s + vp, s + 2 * vp, s + 3 * vp, vp, dp, v,
                mask_id};
  std::unique_ptr<float[]> upper(new float[n * vp]);  // every element is written before it is read
  const int threads = at::get_num_threads();
  std::vector<float> extremes(threads * 2 * kMaxRows, kNegInf);  // per thread: rows' largest lower, upper
#if defined(__AVX512BF16__)
  const auto bounds = amx ? mtplm::head::amx_bounds : mtplm::fewrow::avx2() ? mtplm::head::avx2_bounds
                                                                           : mtplm::head::avx512_bounds;
#else
  const auto bounds = mtplm::head::avx2_bounds;
#endif
  at::parallel_for(0, vp / kBlock, 64, [&](int64_t begin, int64_t end) {
    float* mine = extremes.data() + at::get_thread_num() * 2 * kMaxRows;
    bounds(x, hd, begin, end, upper.get(), mine, mine + kMaxRows);
  });
  float threshold[kMaxRows];
  bool finite = true;
  for (int64_t r = 0; r < n; ++r) {
    float low = kNegInf, high = kNegInf;
    for (int t = 0; t < threads; ++t) {
      low = std::max(low, extremes[t * 2 * kMaxRows + r]);
      high = std::max(high, extremes[t * 2 * kMaxRows + kMaxRows + r]);
    }
    // bf16 keeps 8 significant bits: float32 sums within 2^-7 of the largest (|it| <= max(|low|, |high|))
    // may round to the same bf16 value, and the argmax takes the first of equals
    threshold[r] = low - (std::max(std::fabs(low), std::fabs(high)) / 64.f + 1e-6f);
    finite = finite && std::isfinite(threshold[r]) && std::isfinite(high);
  }
  if (!finite) return at::full({n}, -1, hidden.options().dtype(at::kLong));
  return exact_argmax(h, packed, candidates(upper.get(), threshold, n, vp), vp);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(mtplm_fewrow, m) {
  m.def("head_argmax(Tensor hidden, Tensor codes, Tensor stats, Tensor packed, int v, int mask_id) -> Tensor");
}

TORCH_LIBRARY_IMPL(mtplm_fewrow, CPU, m) { m.impl("head_argmax", head_argmax); }
