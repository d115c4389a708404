// attend.cpp's sums on AVX-512: scores by vdpbf16ps (bf16) or FMA (float32) chains, 16 keys' lane sums in
// one shuffle tree, values 16 float32 lanes at a time (attend.cpp states the sums and why their order holds).

#include "attend.h"

#include <immintrin.h>

#include <algorithm>
#include <cstdint>

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

}  // namespace

template <typename T>
void mtplm::attend::avx512_task(const Head<T>& h, const T* const* q, const float* const* mask, float* const* p,
                                T* const* o, int rows) {
  probabilities(h, q, mask, p, rows);
  h.d == 64 ? values_in_groups<4>(h, p, o, rows) : values_in_groups<8>(h, p, o, rows);
}

template void mtplm::attend::avx512_task<uint16_t>(const Head<uint16_t>&, const uint16_t* const*,
                                                   const float* const*, float* const*, uint16_t* const*, int);
template void mtplm::attend::avx512_task<float>(const Head<float>&, const float* const*, const float* const*,
                                                float* const*, float* const*, int);
