// What attend.cpp (the op) and its kernels per ISA (attend_avx512.cpp, attend_avx2.cpp, attend_amx.cpp) share:
// one KV head's view, the prefetch, the kernels' entries, and on AVX-512 the loads and the exp.
#pragma once

#include <immintrin.h>

#include <cstdint>

namespace mtplm::attend {

constexpr int kRowsPerTask = 16;  // at most this many query rows of one KV head per parallel task

// The store's rows stream from memory (a layer's K and V leave the cache while the weights pass through);
// the hardware prefetcher alone left attention inside a pass 2-3x slower than with a warm cache. A prefetch
// past the store's end is a hint that never faults.
constexpr int kPrefetchKeys = 32;
template <typename T>
inline void ahead(const T* row, int64_t d) {  // one key's or value's d elements towards L1
  const char* bytes = reinterpret_cast<const char*>(row);
  for (int64_t b = 0; b < d * int64_t(sizeof(T)); b += 64) _mm_prefetch(bytes + b, _MM_HINT_T0);
}

template <typename T>
struct Head {  // one sequence's KV head, over the first t keys
  const T* keys;    // [C, d]
  const T* values;  // [C, d]
  int64_t t, d;
  float scaling;
};

// Keys [0, n) hold every key a mask row lets its row read (mask above float32's lowest); all T where it
// reads none. The keys after it would add exactly +0 to every sum: skipping them (the pass's key count is
// bucketed, so often a third of them) changes no bit.
inline int64_t readable(const float* mask, int64_t t) {
  for (int64_t j = t; j > 0; --j)
    if (mask[j - 1] > -__FLT_MAX__) return j;
  return t;
}

// exp_nonpositive's constants (its AVX-512 form below, the AVX2 one in attend_avx2.cpp): x = n ln2 + r with
// ln2 in two parts, e^r by Taylor to r^6 on |r| <= ln2 / 2 (Horner, highest term first), 0 below kExpFloor.
constexpr float kExpFloor = -87.0f, kLog2E = 1.44269504f, kLn2High = 0.693359375f, kLn2Low = -2.12194440e-4f;
constexpr int kExpTerms = 7;
constexpr float kExpTaylor[kExpTerms] = {1.0f / 720, 1.0f / 120, 1.0f / 24, 1.0f / 6, 0.5f, 1.0f, 1.0f};

#if defined(__AVX512F__)
// 16 elements as float32, and back; bf16 is held as uint16_t
inline __m512 load16(const uint16_t* from) {
  const __m256i half = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(from));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(half), 16));
}
inline __m512 load16(const float* from) { return _mm512_loadu_ps(from); }
inline void store16(uint16_t* to, __m512 x) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(to), (__m256i)_mm512_cvtneps_pbh(x));
}
inline void store16(float* to, __m512 x) { _mm512_storeu_ps(to, x); }

// e^x for x <= 0 in float32 (|relative error| ~1e-7); 0 below -87 (where float32 would go subnormal).
inline __m512 exp_nonpositive(__m512 x) {
  const __mmask16 live = _mm512_cmp_ps_mask(x, _mm512_set1_ps(kExpFloor), _CMP_GE_OQ);
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(kLog2E)), _MM_FROUND_TO_NEAREST_INT);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(kLn2High), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(kLn2Low), r);
  __m512 p = _mm512_set1_ps(kExpTaylor[0]);
  for (int i = 1; i < kExpTerms; ++i) p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(kExpTaylor[i]));
  return _mm512_maskz_scalef_ps(live, p, n);
}

inline __mmask16 lanes(int64_t count) { return count >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << count) - 1); }
#endif

// One task's rows (<= kRowsPerTask of one KV head, t <= T keys each): the probabilities into p[r] (t floats),
// then the outputs into o[r], on AVX-512 (attend_avx512.cpp, the AVX-512 build) or AVX2 + FMA
// (attend_avx2.cpp, every build).
template <typename T>
void avx512_task(const Head<T>& h, const T* const* q, const float* const* mask, float* const* p, T* const* o,
                 int rows);
template <typename T>
void avx2_task(const Head<T>& h, const T* const* q, const float* const* mask, float* const* p, T* const* o,
               int rows);

// One task's rows (<= kRowsPerTask of one KV head, bf16, d = 64) through AMX tiles; scratch holds at least
// 16 * (t + 32) floats.
void amx_task(const Head<uint16_t>& h, const uint16_t* const* q, const float* const* mask, uint16_t* const* o,
              int rows, float* scratch);

}  // namespace mtplm::attend
