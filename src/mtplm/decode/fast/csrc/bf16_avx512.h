// bf16 <-> float32 for one block of 16 outputs on AVX-512 (fewrow_avx512.cpp's register tiles and
// fewrow_amx.cpp's tile stores): a bias loaded as float32, a row's sums rounded to bf16 (to nearest even).
#pragma once

#include "fewrow.h"

#include <immintrin.h>

#include <cstdint>

namespace mtplm::fewrow {

inline __m512 load_bias(const uint16_t* bias, int64_t col, int64_t m) {
  if (bias == nullptr) return _mm512_setzero_ps();
  __mmask16 mask = col + kBlock <= m ? __mmask16(0xFFFF) : __mmask16((1u << (m - col)) - 1);
  __m256i half = _mm256_maskz_loadu_epi16(mask, bias + col);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(half), 16));
}

inline void store_row(uint16_t* y, int64_t col, int64_t m, __m512 value) {
  __mmask16 mask = col + kBlock <= m ? __mmask16(0xFFFF) : __mmask16((1u << (m - col)) - 1);
  __m256i half = (__m256i)_mm512_cvtneps_pbh(value);
  _mm256_mask_storeu_epi16(y + col, mask, half);
}

}  // namespace mtplm::fewrow
