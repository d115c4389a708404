// head.cpp's bounds on AMX tiles (two int8 levels) and AVX-512 VNNI (one int16 level): the AVX-512 build.

#include "fewrow.h"
#include "head.h"

#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <limits>

namespace {

using mtplm::fewrow::TileConfig;
using mtplm::head::Head;
using mtplm::head::kBlock;
using mtplm::head::kMaxRows;
using mtplm::head::Rows;
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

// Block `block`'s bounds for every row from its int32 dots (dot1: level one, dot2: level two or null):
// upper bounds stored to upper [N, Vp], each row's largest lower and upper bounds kept.
void bound_block(const Rows& x, const Head& hd, int64_t block, const int32_t* dot1, const int32_t* dot2,
                 float* upper, __m512* lower, __m512* higher) {
  const int64_t col = block * kBlock;
  const __m512 scale = _mm512_loadu_ps(hd.scale + col), residual = _mm512_loadu_ps(hd.residual + col);
  const __m512 spread = _mm512_loadu_ps(hd.spread + col), largest = _mm512_loadu_ps(hd.largest + col);
  const __m512i token = _mm512_add_epi32(_mm512_set1_epi32(int32_t(col)),
                                         _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15));
  const __mmask16 valid = _mm512_cmplt_epi32_mask(token, _mm512_set1_epi32(int32_t(hd.v))) &
                          _mm512_cmpneq_epi32_mask(token, _mm512_set1_epi32(int32_t(hd.mask_id)));
  const __m512 inf = _mm512_set1_ps(kNegInf), sums = _mm512_set1_ps(float(hd.dp) / 4194304.f);  // D 2^-22
  for (int64_t r = 0; r < x.n; ++r) {
    __m512 dot = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_loadu_si512(dot1 + r * kBlock)), _mm512_set1_ps(x.s1[r]));
    if (dot2 != nullptr)
      dot = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_loadu_si512(dot2 + r * kBlock)), _mm512_set1_ps(x.s2[r]), dot);
    const __m512 approx = _mm512_mul_ps(dot, scale), l1 = _mm512_set1_ps(x.l1[r]);
    __m512 bound = _mm512_fmadd_ps(l1, residual, _mm512_mul_ps(_mm512_set1_ps(x.residual[r]), spread));
    bound = _mm512_fmadd_ps(_mm512_mul_ps(l1, sums), largest, bound);
    bound = _mm512_fmadd_ps(_mm512_abs_ps(approx), _mm512_set1_ps(1.f / 1048576.f), bound);
    const __m512 high = _mm512_mask_blend_ps(valid, inf, _mm512_add_ps(approx, bound));
    _mm512_storeu_ps(upper + r * hd.vp + col, high);
    lower[r] = _mm512_max_ps(lower[r], _mm512_mask_blend_ps(valid, inf, _mm512_sub_ps(approx, bound)));
    higher[r] = _mm512_max_ps(higher[r], high);
  }
}

// AMX: tiles 0, 1 the row's two levels, 2 a block's codes, 4, 5 the dots by level. Codes two blocks on are
// prefetched (the tile loads stall on memory otherwise; two blocks a step measured slower).
__attribute__((target("amx-tile,amx-int8")))
void amx_range(const Rows& x, const Head& hd, int64_t begin, int64_t end, float* upper, __m512* lower,
                __m512* higher) {
  TileConfig config{};
  config.palette = 1;
  for (int t : {0, 1, 4, 5}) config.rows[t] = uint8_t(x.n), config.colsb[t] = 64;
  config.rows[2] = 16, config.colsb[2] = 64;
  asm volatile("" : : "r"(&config) : "memory");  // see fewrow.cpp's amx_configure
  _tile_loadconfig(&config);
  alignas(64) int32_t dot1[kMaxRows * kBlock], dot2[kMaxRows * kBlock];
  for (int64_t block = begin; block < end; ++block) {
    const int8_t* w = hd.codes + block * hd.dp * kBlock;
    const char* ahead = reinterpret_cast<const char*>(w + 2 * hd.dp * kBlock);
    _tile_zero(4);
    _tile_zero(5);
    for (int64_t k = 0; k < hd.dp; k += 64) {
      if (block + 2 < end)
        for (int line = 0; line < 16; ++line) _mm_prefetch(ahead + k * kBlock + line * 64, _MM_HINT_T0);
      _tile_loadd(0, x.high.data() + k, x.dp);
      _tile_loadd(1, x.low.data() + k, x.dp);
      _tile_loadd(2, w + k * kBlock, 64);
      _tile_dpbssd(4, 0, 2);
      _tile_dpbssd(5, 1, 2);
    }
    _tile_stored(4, dot1, 64);
    _tile_stored(5, dot2, 64);
    bound_block(x, hd, block, dot1, dot2, upper, lower, higher);
  }
  _tile_release();
}

// AVX-512: per 64 bytes (16 tokens x 4 inputs) the codes widened to int16 once, in two halves (tokens 0-7,
// 8-15 as [8][4]), then per row of a tile one vpdpwssd per half with the row's four inputs: lanes (token,
// input pair) come out two per token, summed at the end.
template <int R>
__attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni")))
void avx512_dots(const Rows& x, int64_t row, const int8_t* w, int64_t dp, int32_t* dot) {
  __m512i lo[R], hi[R];
  for (int r = 0; r < R; ++r) lo[r] = hi[r] = _mm512_setzero_si512();
  for (int64_t k = 0; k < dp; k += 4) {
    const __m512i codes = _mm512_loadu_si512(w + k * kBlock);
    const __m512i first = _mm512_cvtepi8_epi16(_mm512_castsi512_si256(codes));
    const __m512i second = _mm512_cvtepi8_epi16(_mm512_extracti64x4_epi64(codes, 1));
    for (int r = 0; r < R; ++r) {
      int64_t quad;
      std::memcpy(&quad, x.wide.data() + (row + r) * x.dp + k, 8);
      const __m512i pairs = _mm512_set1_epi64(quad);  // lanes alternate the inputs' first and second pair
      lo[r] = _mm512_dpwssd_epi32(lo[r], pairs, first);
      hi[r] = _mm512_dpwssd_epi32(hi[r], pairs, second);
    }
  }
  const __m512i even = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 0, 2, 4, 6, 8, 10, 12, 14);
  const __m512i odd = _mm512_add_epi32(even, _mm512_set1_epi32(1));
  for (int r = 0; r < R; ++r) {  // lanes 0-7 of each sum: its half's 8 tokens
    const __m512i a = _mm512_add_epi32(_mm512_permutexvar_epi32(even, lo[r]), _mm512_permutexvar_epi32(odd, lo[r]));
    const __m512i b = _mm512_add_epi32(_mm512_permutexvar_epi32(even, hi[r]), _mm512_permutexvar_epi32(odd, hi[r]));
    _mm512_storeu_si512(dot + (row + r) * kBlock, _mm512_inserti64x4(a, _mm512_castsi512_si256(b), 1));
  }
}

using DotsFn = void (*)(const Rows&, int64_t, const int8_t*, int64_t, int32_t*);

DotsFn avx512_tile(int64_t rows) {
  switch (rows) {
    case 1: return avx512_dots<1>;
    case 2: return avx512_dots<2>;
    case 3: return avx512_dots<3>;
    case 4: return avx512_dots<4>;
    case 5: return avx512_dots<5>;
    case 6: return avx512_dots<6>;
    case 7: return avx512_dots<7>;
    default: return avx512_dots<8>;
  }
}

void avx512_range(const Rows& x, const Head& hd, int64_t begin, int64_t end, float* upper, __m512* lower,
                   __m512* higher) {
  alignas(64) int32_t dot[kMaxRows * kBlock];
  for (int64_t block = begin; block < end; ++block) {
    const int8_t* w = hd.codes + block * hd.dp * kBlock;
    for (int64_t row = 0; row < x.n; row += 8) avx512_tile(std::min<int64_t>(8, x.n - row))(x, row, w, hd.dp, dot);
    bound_block(x, hd, block, dot, nullptr, upper, lower, higher);
  }
}

using RangeFn = void (*)(const Rows&, const Head&, int64_t, int64_t, float*, __m512*, __m512*);

void bounds(RangeFn range, const Rows& x, const Head& hd, int64_t begin, int64_t end, float* upper, float* low,
            float* high) {
  __m512 lower[kMaxRows], higher[kMaxRows];
  for (int64_t r = 0; r < x.n; ++r) lower[r] = higher[r] = _mm512_set1_ps(kNegInf);
  range(x, hd, begin, end, upper, lower, higher);
  for (int64_t r = 0; r < x.n; ++r) {
    low[r] = std::max(low[r], _mm512_reduce_max_ps(lower[r]));
    high[r] = std::max(high[r], _mm512_reduce_max_ps(higher[r]));
  }
}

}  // namespace

void mtplm::head::amx_bounds(const Rows& x, const Head& hd, int64_t begin, int64_t end, float* upper, float* lower,
                             float* higher) {
  bounds(amx_range, x, hd, begin, end, upper, lower, higher);
}

void mtplm::head::avx512_bounds(const Rows& x, const Head& hd, int64_t begin, int64_t end, float* upper,
                                float* lower, float* higher) {
  bounds(avx512_range, x, hd, begin, end, upper, lower, higher);
}
