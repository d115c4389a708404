// head.cpp's bounds on AVX2 (one int16 level of the row): per 64 bytes of codes (16 tokens x 4 inputs), four
// widenings to int16 (4 tokens each), then per row one vpmaddwd per widening with the row's four inputs
// broadcast: int32 lanes (token, input pair), summed in pairs at the end. The dots are exact, as on AVX-512.

#include "head.h"

#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <limits>

#define MTPLM_AVX2 __attribute__((target("avx2,fma")))

namespace {

using mtplm::head::Head;
using mtplm::head::kBlock;
using mtplm::head::kMaxRows;
using mtplm::head::Rows;
constexpr int kTileRows = 2;  // rows whose accumulators (4 each) share the registers
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

// dot [N, 16]: rows [row, row + R) . the 16 tokens of the block at w, in int32.
template <int R>
MTPLM_AVX2 void dots(const Rows& x, int64_t row, const int8_t* w, int64_t dp, int32_t* dot) {
  __m256i acc[R][4];
  for (int r = 0; r < R; ++r)
    for (auto& a : acc[r]) a = _mm256_setzero_si256();
  for (int64_t k = 0; k < dp; k += 4) {
    const __m256i first = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + k * kBlock));
    const __m256i second = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + k * kBlock + 32));
    const __m256i codes[4] = {  // tokens 0-3, 4-7, 8-11, 12-15, [4][4] int16 each
        _mm256_cvtepi8_epi16(_mm256_castsi256_si128(first)), _mm256_cvtepi8_epi16(_mm256_extracti128_si256(first, 1)),
        _mm256_cvtepi8_epi16(_mm256_castsi256_si128(second)),
        _mm256_cvtepi8_epi16(_mm256_extracti128_si256(second, 1))};
    for (int r = 0; r < R; ++r) {
      int64_t quad;
      std::memcpy(&quad, x.wide.data() + (row + r) * x.dp + k, 8);
      const __m256i inputs = _mm256_set1_epi64x(quad);
      for (int g = 0; g < 4; ++g) acc[r][g] = _mm256_add_epi32(acc[r][g], _mm256_madd_epi16(inputs, codes[g]));
    }
  }
  for (int r = 0; r < R; ++r) {  // hadd gives tokens 0, 1, 4, 5 | 2, 3, 6, 7: the 64-bit pairs put in order
    const __m256i low = _mm256_permute4x64_epi64(_mm256_hadd_epi32(acc[r][0], acc[r][1]), 0xD8);
    const __m256i high = _mm256_permute4x64_epi64(_mm256_hadd_epi32(acc[r][2], acc[r][3]), 0xD8);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(dot + (row + r) * kBlock), low);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(dot + (row + r) * kBlock + 8), high);
  }
}

// The bounds of block `block`'s tokens from their dots, 8 at a time (head.cpp's formula).
MTPLM_AVX2 void bound_block(const Rows& x, const Head& hd, int64_t block, const int32_t* dot, float* upper,
                            __m256* lower, __m256* higher) {
  const __m256 inf = _mm256_set1_ps(kNegInf), sums = _mm256_set1_ps(float(hd.dp) / 4194304.f);  // D 2^-22
  const __m256 magnitude = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
  for (int64_t half = 0; half < 2; ++half) {
    const int64_t col = block * kBlock + 8 * half;
    const __m256 scale = _mm256_loadu_ps(hd.scale + col), residual = _mm256_loadu_ps(hd.residual + col);
    const __m256 spread = _mm256_loadu_ps(hd.spread + col), largest = _mm256_loadu_ps(hd.largest + col);
    const __m256i token = _mm256_add_epi32(_mm256_set1_epi32(int32_t(col)), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
    const __m256i real = _mm256_cmpgt_epi32(_mm256_set1_epi32(int32_t(hd.v)), token);
    const __m256 valid = _mm256_castsi256_ps(
        _mm256_andnot_si256(_mm256_cmpeq_epi32(token, _mm256_set1_epi32(int32_t(hd.mask_id))), real));
    for (int64_t r = 0; r < x.n; ++r) {
      const __m256i sum = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(dot + r * kBlock + 8 * half));
      const __m256 approx = _mm256_mul_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(sum), _mm256_set1_ps(x.s1[r])), scale);
      const __m256 l1 = _mm256_set1_ps(x.l1[r]);
      __m256 bound = _mm256_fmadd_ps(l1, residual, _mm256_mul_ps(_mm256_set1_ps(x.residual[r]), spread));
      bound = _mm256_fmadd_ps(_mm256_mul_ps(l1, sums), largest, bound);
      bound = _mm256_fmadd_ps(_mm256_and_ps(approx, magnitude), _mm256_set1_ps(1.f / 1048576.f), bound);
      const __m256 high = _mm256_blendv_ps(inf, _mm256_add_ps(approx, bound), valid);
      _mm256_storeu_ps(upper + r * hd.vp + col, high);
      lower[r] = _mm256_max_ps(lower[r], _mm256_blendv_ps(inf, _mm256_sub_ps(approx, bound), valid));
      higher[r] = _mm256_max_ps(higher[r], high);
    }
  }
}

MTPLM_AVX2 float lane_max(__m256 x) {
  __m128 four = _mm_max_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
  four = _mm_max_ps(four, _mm_movehl_ps(four, four));
  return _mm_cvtss_f32(_mm_max_ss(four, _mm_movehdup_ps(four)));
}

}  // namespace

MTPLM_AVX2 void mtplm::head::avx2_bounds(const Rows& x, const Head& hd, int64_t begin, int64_t end, float* upper,
                                         float* low, float* high) {
  alignas(32) int32_t dot[kMaxRows * kBlock];
  __m256 lower[kMaxRows], higher[kMaxRows];
  for (int64_t r = 0; r < x.n; ++r) lower[r] = higher[r] = _mm256_set1_ps(kNegInf);
  for (int64_t block = begin; block < end; ++block) {
    const int8_t* w = hd.codes + block * hd.dp * kBlock;
    for (int64_t row = 0; row < x.n; row += kTileRows)
      x.n - row >= 2 ? dots<2>(x, row, w, hd.dp, dot) : dots<1>(x, row, w, hd.dp, dot);
    bound_block(x, hd, block, dot, upper, lower, higher);
  }
  for (int64_t r = 0; r < x.n; ++r) {
    low[r] = std::max(low[r], lane_max(lower[r]));
    high[r] = std::max(high[r], lane_max(higher[r]));
  }
}
