// attend.cpp's sums on AVX2 + FMA, 8 float32 lanes (attend.cpp states the sums and why their order holds):
//   score_j = scaling * (q . k_j) + mask_j    an FMA chain over d in 8 lanes (element e in lane e % 8, in
//                                            order), the 8 lanes then summed in one fixed tree
//   p_j     = exp(score_j - max)             this file's polynomial (attend.h's, on 8 lanes)
//   out     = (sum_j p_j v_j) / (sum_j p_j)  both sums key by key, in key order
// Every order is fixed by the row and the keys it reads; none depends on the task's other rows.
//
// A task's rows share its keys and values, so each is widened to float32 once (8 keys, or 32 values, at a
// time, into a scratch that stays in L1) and read by every row; a row scores 8 keys at once (8 independent
// FMA chains), and their 8 lane trees are summed together by shuffles that add exactly the operands the
// one-key tree adds. One layer of SmolLM2 (9 heads over 3 KV heads, head dim 64, 600 keys, 2 threads, an
// AVX2-only AMD EPYC), 1 / 4 / 8 rows: about 0.6x / 0.5x / 0.45x the time of the key-by-key form before it
// (medians of 6 alternated runs), with bit for bit the same results (scripts/probes/attend_cost.py).

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

constexpr int kKeyBlock = 8;     // keys scored together: one row's query against 8 keys, 8 accumulators
constexpr int kValueBlock = 32;  // keys whose values are made float32 at a time, then read by every row
constexpr int kMaxDim = 128;

// A task's operands as float32, made once and read by every row (each key and value is widened once, not once
// per row), and the rows' running value sums.
struct Scratch {
  alignas(32) float queries[mtplm::attend::kRowsPerTask * kMaxDim];
  alignas(32) float keys[kKeyBlock * kMaxDim];
  alignas(32) float values[kValueBlock * kMaxDim];
  alignas(32) float sums[mtplm::attend::kRowsPerTask * kMaxDim];
};

template <typename T>
MTPLM_AVX2 inline void widen(const T* from, int64_t d, float* to) {
  for (int64_t e = 0; e < d; e += 8) _mm256_store_ps(to + e, load8(from + e));
}

// 8 keys' accumulators -> their 8 dots, key k in lane k, each summed in lane_sum's tree: lanes (i, i + 4) of a
// key first (two keys a register), then (0 + 2) and (1 + 3) of those, then the two. Each add is lane_sum's, on
// the same operands, so the bits are the same.
MTPLM_AVX2 inline __m256 lane_sums(const __m256 (&a)[kKeyBlock]) {
  __m256 half[4];
  for (int k = 0; k < 4; ++k)
    half[k] = _mm256_add_ps(_mm256_permute2f128_ps(a[2 * k], a[2 * k + 1], 0x20),
                            _mm256_permute2f128_ps(a[2 * k], a[2 * k + 1], 0x31));
  // half[k]: key 2k's four partial sums in the low 128 bits, key 2k + 1's in the high
  const __m256 low = _mm256_add_ps(_mm256_shuffle_ps(half[0], half[1], 0x44), _mm256_shuffle_ps(half[0], half[1], 0xEE));
  const __m256 high = _mm256_add_ps(_mm256_shuffle_ps(half[2], half[3], 0x44), _mm256_shuffle_ps(half[2], half[3], 0xEE));
  // low: keys 0, 2 (low 128 bits) and 1, 3 (high), two partial sums each; high: keys 4-7 alike
  const __m256 sums = _mm256_add_ps(_mm256_shuffle_ps(low, high, 0x88), _mm256_shuffle_ps(low, high, 0xDD));
  // lanes hold keys 0, 2, 4, 6, 1, 3, 5, 7
  return _mm256_permutevar8x32_ps(sums, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
}

// p[r][j] = scaling * q_r . k_j + mask_r[j] for j < t: 8 keys at a time widened once for every row, the keys
// after the last multiple of 8 one by one.
template <typename T>
MTPLM_AVX2 void scores(const Head<T>& h, const float* q, const float* const* mask, float* const* p, int rows,
                       Scratch& s) {
  const int64_t d = h.d;
  const __m256 scaling = _mm256_set1_ps(h.scaling);
  int64_t j = 0;
  for (; j + kKeyBlock <= h.t; j += kKeyBlock) {
    for (int k = 0; k < kKeyBlock; ++k) {
      const T* key = h.keys + (j + k) * d;
      mtplm::attend::ahead(key + kPrefetchKeys * d, d);
      widen(key, d, s.keys + k * d);
    }
    for (int r = 0; r < rows; ++r) {
      __m256 a[kKeyBlock];
      for (auto& x : a) x = _mm256_setzero_ps();
      for (int64_t e = 0; e < d; e += 8) {
        const __m256 x = _mm256_load_ps(q + r * d + e);
        for (int k = 0; k < kKeyBlock; ++k) a[k] = _mm256_fmadd_ps(x, _mm256_load_ps(s.keys + k * d + e), a[k]);
      }
      const __m256 score = _mm256_mul_ps(lane_sums(a), scaling);
      _mm256_storeu_ps(p[r] + j, _mm256_add_ps(score, _mm256_loadu_ps(mask[r] + j)));
    }
  }
  for (; j < h.t; ++j) {
    widen(h.keys + j * d, d, s.keys);
    for (int r = 0; r < rows; ++r) {
      const __m128 score = _mm_mul_ss(_mm_set_ss(dot(q + r * d, s.keys, d)), _mm_set_ss(h.scaling));
      p[r][j] = _mm_cvtss_f32(_mm_add_ss(score, _mm_set_ss(mask[r][j])));
    }
  }
}

// p[r][j] = exp(p[r][j] - max_j p[r][j]), in place.
MTPLM_AVX2 void exponentials(float* p, int64_t t) {
  float high = -__FLT_MAX__;
  for (int64_t j = 0; j < t; ++j) high = std::max(high, p[j]);
  const __m256 top = _mm256_set1_ps(high);
  int64_t j = 0;
  for (; j + 8 <= t; j += 8) _mm256_storeu_ps(p + j, exp_nonpositive(_mm256_sub_ps(_mm256_loadu_ps(p + j), top)));
  if (j < t) {  // the last few through a zero-padded copy
    alignas(32) float last[8] = {};
    std::copy(p + j, p + t, last);
    _mm256_store_ps(last, exp_nonpositive(_mm256_sub_ps(_mm256_load_ps(last), top)));
    std::copy(last, last + (t - j), p + j);
  }
}

// sums[r] = sum_j p[r][j] v_j, keys in order for every element: the values widened kValueBlock keys at a time,
// each row's running sums carried from block to block in Scratch.
template <typename T>
MTPLM_AVX2 void weighted_values(const Head<T>& h, const float* const* p, int rows, Scratch& s) {
  const int64_t d = h.d;
  std::fill(s.sums, s.sums + rows * d, 0.0f);
  for (int64_t j = 0; j < h.t; j += kValueBlock) {
    const int64_t n = std::min<int64_t>(kValueBlock, h.t - j);
    for (int64_t i = 0; i < n; ++i) {
      const T* v = h.values + (j + i) * d;
      mtplm::attend::ahead(v + kPrefetchKeys * d, d);
      widen(v, d, s.values + i * d);
    }
    for (int r = 0; r < rows; ++r) {
      for (int64_t first = 0; first < d; first += 64) {
        float* sum = s.sums + r * d + first;
        __m256 acc[8];
        for (int c = 0; c < 8; ++c) acc[c] = _mm256_load_ps(sum + 8 * c);
        for (int64_t i = 0; i < n; ++i) {
          const __m256 weight = _mm256_broadcast_ss(p[r] + j + i);
          const float* v = s.values + i * d + first;
          for (int c = 0; c < 8; ++c) acc[c] = _mm256_fmadd_ps(weight, _mm256_load_ps(v + 8 * c), acc[c]);
        }
        for (int c = 0; c < 8; ++c) _mm256_store_ps(sum + 8 * c, acc[c]);
      }
    }
  }
}

}  // namespace

template <typename T>
MTPLM_AVX2 void mtplm::attend::avx2_task(const Head<T>& h, const T* const* q, const float* const* mask,
                                         float* const* p, T* const* o, int rows) {
  Scratch s;
  for (int r = 0; r < rows; ++r) widen(q[r], h.d, s.queries + r * h.d);
  scores(h, s.queries, mask, p, rows, s);
  float total[kRowsPerTask] = {};
  for (int r = 0; r < rows; ++r) exponentials(p[r], h.t);
  for (int64_t j = 0; j < h.t; ++j)  // key by key for each row (the rows' chains side by side)
    for (int r = 0; r < rows; ++r) total[r] += p[r][j];
  weighted_values(h, p, rows, s);
  alignas(32) float lanes[8];
  for (int r = 0; r < rows; ++r) {
    const __m256 scale = _mm256_div_ps(_mm256_set1_ps(1.0f), _mm256_set1_ps(total[r]));
    for (int64_t e = 0; e < h.d; e += 8) {
      _mm256_store_ps(lanes, _mm256_mul_ps(_mm256_load_ps(s.sums + r * h.d + e), scale));
      for (int l = 0; l < 8; ++l) store(o[r] + e + l, lanes[l]);
    }
  }
}

template void mtplm::attend::avx2_task<uint16_t>(const Head<uint16_t>&, const uint16_t* const*,
                                                 const float* const*, float* const*, uint16_t* const*, int);
template void mtplm::attend::avx2_task<float>(const Head<float>&, const float* const*, const float* const*,
                                              float* const*, float* const*, int);
