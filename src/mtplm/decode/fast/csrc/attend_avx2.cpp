// attend.cpp's sums on AVX2 + FMA, 8 float32 lanes (attend.cpp states the sums and why their order holds):
//   score_j = scaling * (q . k_j) + mask_j    an FMA chain over d in 8 lanes (element e in lane e % 8, in
//                                            order), the 8 lanes then summed in one fixed tree
//   p_j     = exp(score_j - max)             this file's polynomial (attend.h's, on 8 lanes)
//   out     = (sum_j p_j v_j) / (sum_j p_j)  both sums key by key, in key order
// Every order is fixed by the row and the keys it reads; none depends on the task's other rows.

#include "attend.h"

#include <c10/util/BFloat16.h>

#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

#define MTPLM_AVX2 __attribute__((target("avx2,fma")))

namespace {

using mtplm::attend::Head;
using mtplm::attend::kPrefetchKeys;

// 8 elements as float32; bf16 is held as uint16_t
MTPLM_AVX2 inline __m256 load8(const uint16_t* from) {
  const __m128i half = _mm_loadu_si128(reinterpret_cast<const __m128i*>(from));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(half), 16));
}
MTPLM_AVX2 inline __m256 load8(const float* from) { return _mm256_loadu_ps(from); }

inline void store(uint16_t* to, float value) {
  const c10::BFloat16 rounded(value);  // to nearest even
  std::memcpy(to, &rounded, 2);
}
inline void store(float* to, float value) { *to = value; }

// lanes 0-7 summed as ((0 + 4) + (2 + 6)) + ((1 + 5) + (3 + 7))
MTPLM_AVX2 inline float lane_sum(__m256 x) {
  __m128 four = _mm_add_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
  four = _mm_add_ps(four, _mm_movehl_ps(four, four));
  return _mm_cvtss_f32(_mm_add_ss(four, _mm_movehdup_ps(four)));
}

template <typename T>
MTPLM_AVX2 inline float dot(const T* q, const T* k, int64_t d) {
  __m256 acc = _mm256_setzero_ps();
  for (int64_t e = 0; e < d; e += 8) acc = _mm256_fmadd_ps(load8(q + e), load8(k + e), acc);
  return lane_sum(acc);
}

// e^x for x <= 0 in float32, 0 below -87: attend.h's exp_nonpositive on 8 lanes (2^n built in the exponent
// field: n >= -126 there, a normal float).
MTPLM_AVX2 inline __m256 exp_nonpositive(__m256 x) {
  using namespace mtplm::attend;
  const __m256 live = _mm256_cmp_ps(x, _mm256_set1_ps(kExpFloor), _CMP_GE_OQ);
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(kLog2E)), _MM_FROUND_TO_NEAREST_INT);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(kLn2High), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(kLn2Low), r);
  __m256 p = _mm256_set1_ps(kExpTaylor[0]);
  for (int i = 1; i < kExpTerms; ++i) p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(kExpTaylor[i]));
  const __m256i exponent = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_and_ps(live, _mm256_mul_ps(p, _mm256_castsi256_ps(exponent)));
}

// p[r][j] = exp(scaling * q_r . k_j + mask_r[j] - max) for j < t, each key read once for every row.
template <typename T>
MTPLM_AVX2 void probabilities(const Head<T>& h, const T* const* q, const float* const* mask, float* const* p,
                              int rows) {
  for (int64_t j = 0; j < h.t; ++j) {
    const T* key = h.keys + j * h.d;
    mtplm::attend::ahead(key + kPrefetchKeys * h.d, h.d);
    for (int r = 0; r < rows; ++r) {
      const __m128 score = _mm_mul_ss(_mm_set_ss(dot(q[r], key, h.d)), _mm_set_ss(h.scaling));
      p[r][j] = _mm_cvtss_f32(_mm_add_ss(score, _mm_set_ss(mask[r][j])));
    }
  }
  for (int r = 0; r < rows; ++r) {
    float high = -__FLT_MAX__;
    for (int64_t j = 0; j < h.t; ++j) high = std::max(high, p[r][j]);
    const __m256 top = _mm256_set1_ps(high);
    int64_t j = 0;
    for (; j + 8 <= h.t; j += 8)
      _mm256_storeu_ps(p[r] + j, exp_nonpositive(_mm256_sub_ps(_mm256_loadu_ps(p[r] + j), top)));
    if (j < h.t) {  // the last few through a zero-padded copy
      alignas(32) float last[8] = {};
      std::copy(p[r] + j, p[r] + h.t, last);
      _mm256_store_ps(last, exp_nonpositive(_mm256_sub_ps(_mm256_load_ps(last), top)));
      std::copy(last, last + (h.t - j), p[r] + j);
    }
  }
}

// out[e] for e in [first, first + 64): sum_j p[j] v_j[e] / total, keys in order.
template <typename T>
MTPLM_AVX2 void weighted_values(const Head<T>& h, const float* p, float total, int64_t first, T* out) {
  __m256 acc[8];
  for (auto& a : acc) a = _mm256_setzero_ps();
  for (int64_t j = 0; j < h.t; ++j) {
    const T* v = h.values + j * h.d + first;
    if (first == 0) mtplm::attend::ahead(h.values + (j + kPrefetchKeys) * h.d, h.d);
    const __m256 weight = _mm256_set1_ps(p[j]);
    for (int c = 0; c < 8; ++c) acc[c] = _mm256_fmadd_ps(weight, load8(v + 8 * c), acc[c]);
  }
  const __m256 scale = _mm256_div_ps(_mm256_set1_ps(1.0f), _mm256_set1_ps(total));
  alignas(32) float lanes[8];
  for (int c = 0; c < 8; ++c) {
    _mm256_store_ps(lanes, _mm256_mul_ps(acc[c], scale));
    for (int l = 0; l < 8; ++l) store(out + first + 8 * c + l, lanes[l]);
  }
}

}  // namespace

template <typename T>
MTPLM_AVX2 void mtplm::attend::avx2_task(const Head<T>& h, const T* const* q, const float* const* mask,
                                         float* const* p, T* const* o, int rows) {
  probabilities(h, q, mask, p, rows);
  for (int r = 0; r < rows; ++r) {
    float total = 0.f;  // key by key
    for (int64_t j = 0; j < h.t; ++j) total += p[r][j];
    for (int64_t first = 0; first < h.d; first += 64) weighted_values(h, p[r], total, first, o[r]);
  }
}

template void mtplm::attend::avx2_task<uint16_t>(const Head<uint16_t>&, const uint16_t* const*,
                                                 const float* const*, float* const*, uint16_t* const*, int);
template void mtplm::attend::avx2_task<float>(const Head<float>&, const float* const*, const float* const*,
                                              float* const*, float* const*, int);
