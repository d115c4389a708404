// RMSNorm's mean of squares, one summation order per row: sum over the row's d elements in 16 float32 lanes
// (AVX-512; 8 on AVX2, where fewrow's isa() says so), 16 at a time in index order (the last few zero-padded),
// then the lanes in one fixed tree. A row's
// result then does not depend on how many rows are normalised together. Inductor's own reduction does: it
// sums a lone row otherwise than each of several (it splits a single output's reduction), which made a
// Qwen2.5-1.5B row's bf16 norm, and from there its greedy token at a near-tie, differ between a 1-row and a
// 2-row pass. x [..., d] float32 -> [..., 1] float32.

#include "fewrow.h"

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <immintrin.h>

#include <algorithm>
#include <cstdint>

namespace {

#if defined(__AVX512F__)
float sum_of_squares_avx512(const float* row, int64_t d) {
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
  return _mm512_reduce_add_ps(acc);
}
#endif

__attribute__((target("avx2,fma"))) float sum_of_squares_avx2(const float* row, int64_t d) {
  __m256 acc = _mm256_setzero_ps();
  int64_t k = 0;
  for (; k + 8 <= d; k += 8) {
    const __m256 v = _mm256_loadu_ps(row + k);
    acc = _mm256_fmadd_ps(v, v, acc);
  }
  if (k < d) {
    alignas(32) float last[8] = {};
    std::copy(row + k, row + d, last);
    const __m256 v = _mm256_load_ps(last);
    acc = _mm256_fmadd_ps(v, v, acc);
  }
  __m128 four = _mm_add_ps(_mm256_castps256_ps128(acc), _mm256_extractf128_ps(acc, 1));
  four = _mm_add_ps(four, _mm_movehl_ps(four, four));
  return _mm_cvtss_f32(_mm_add_ss(four, _mm_movehdup_ps(four)));
}

at::Tensor mean_square(const at::Tensor& x) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.dim() >= 1, "mtplm mean_square: float32 [..., d]");
  const at::Tensor rows = x.contiguous();
  const int64_t d = rows.size(-1), n = d == 0 ? 0 : rows.numel() / d;
  std::vector<int64_t> sizes = rows.sizes().vec();
  sizes.back() = 1;
  at::Tensor out = at::empty(sizes, rows.options());
  const float* in = rows.data_ptr<float>();
  float* result = out.data_ptr<float>();
#if defined(__AVX512F__)
  const auto sum = mtplm::fewrow::avx2() ? sum_of_squares_avx2 : sum_of_squares_avx512;
#else
  const auto sum = sum_of_squares_avx2;
#endif
  at::parallel_for(0, n, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) result[r] = sum(in + r * d, d) / static_cast<float>(d);
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(mtplm_fewrow, m) { m.def("mean_square(Tensor x) -> Tensor"); }

TORCH_LIBRARY_IMPL(mtplm_fewrow, CPU, m) { m.impl("mean_square", mean_square); }
