// RMSNorm's mean of squares, one summation order per row: sum over the row's d elements in 16 float32 lanes,
// 16 at a time in index order (a masked load for the last few), then the lanes in one fixed tree. A row's
// result then does not depend on how many rows are normalised together. Inductor's own reduction does: it
// sums a lone row otherwise than each of several (it splits a single output's reduction), which made a
// Qwen2.5-1.5B row's bf16 norm, and from there its greedy token at a near-tie, differ between a 1-row and a
// 2-row pass. x [..., d] float32 -> [..., 1] float32.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <immintrin.h>

#include <cstdint>

namespace {

at::Tensor mean_square(const at::Tensor& x) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.dim() >= 1, "mtplm mean_square: float32 [..., d]");
  const at::Tensor rows = x.contiguous();
  const int64_t d = rows.size(-1), n = d == 0 ? 0 : rows.numel() / d;
  std::vector<int64_t> sizes = rows.sizes().vec();
  sizes.back() = 1;
  at::Tensor out = at::empty(sizes, rows.options());
  const float* in = rows.data_ptr<float>();
  float* result = out.data_ptr<float>();
  at::parallel_for(0, n, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float* row = in + r * d;
      __m512 acc = _mm512_setzero_ps();
      int64_t k = 0;
      for (; k + 16 <= d; k += 16) {
        const __m512 v = _mm512_loadu_ps(row + k);
        acc = _mm512_fmadd_ps(v, v, acc);
      }
      if (k < d) {
        const __m512 v = _mm512_maskz_loadu_ps(__mmask16((1u << (d - k)) - 1), row + k);
        acc = _mm512_fmadd_ps(v, v, acc);
      }
      result[r] = _mm512_reduce_add_ps(acc) / static_cast<float>(d);
    }
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(mtplm_fewrow, m) { m.def("mean_square(Tensor x) -> Tensor"); }

TORCH_LIBRARY_IMPL(mtplm_fewrow, CPU, m) { m.impl("mean_square", mean_square); }
