// quant.cpp's products on AVX-512 VNNI (the AVX-512 build; quant.cpp states the math and the record layout).
//
// A record's vector is one vpdpbusd operand: 16 outputs x 4 inputs of unsigned codes. Per block (32 inputs)
// a record's 8 vectors are loaded (and, for 4-bit codes, split into nibbles) once, then every row of the
// tile multiplies them: 8 vpdpbusd with the row's 4 inputs broadcast, then one float32 fma (two for Q4_1,
// Q4_K and Q5_K; Q6_K first scales its two halves' sums by their int8 scales, vpmulld). The K-quants'
// per-block scales (Q4_K, Q5_K: d * sc_j and dmin * m_j) are made once per record and block, for every row of
// the tile.
// So extra rows cost their dot products, not their weight reads. A tile of up to 8 rows keeps its sums in
// registers; more rows run further tiles over the same record, read again from cache.

#include "quant.h"

#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512vnni,avx512bf16,f16c,fma")

namespace {

using mtplm::quant::Kind;
using mtplm::quant::Problem;
using mtplm::quant::fifth_bits;
using mtplm::quant::has_min;
using mtplm::quant::record_bytes;
using mtplm::quant::record_scales;
using mtplm::quant::scale_blocks;
using mtplm::quant::sub_scales;
constexpr int kTileRows = 8;  // rows whose sums share the registers

// A record's block: its 8 vectors of unsigned codes (vector t: inputs 4t .. 4t + 3 of the 16 outputs).
template <Kind K>
inline void unpack(const uint8_t* record, __m512i (&w)[8]) {
  if constexpr (K == Kind::Q8_0) {
    const __m512i flip = _mm512_set1_epi8(static_cast<char>(0x80));
    for (int t = 0; t < 8; ++t) w[t] = _mm512_xor_si512(_mm512_loadu_si512(record + 64 * t), flip);
  } else {
    const __m512i nibble = _mm512_set1_epi8(15);
    for (int v = 0; v < 4; ++v) {
      const __m512i bytes = _mm512_loadu_si512(record + 64 * v);
      w[v] = _mm512_and_si512(bytes, nibble);
      w[v + 4] = _mm512_and_si512(_mm512_srli_epi16(bytes, 4), nibble);
    }
    if constexpr (K == Kind::Q6_K) {  // high 2 bits: vector u, bits 2i, 2i + 1 of byte (o, j) -> t = 4u + i
      const __m512i two = _mm512_set1_epi8(0x30);
      for (int u = 0; u < 2; ++u) {
        const __m512i bits = _mm512_loadu_si512(record + 256 + 64 * u);
        w[4 * u] = _mm512_or_si512(w[4 * u], _mm512_and_si512(_mm512_slli_epi16(bits, 4), two));
        w[4 * u + 1] = _mm512_or_si512(w[4 * u + 1], _mm512_and_si512(_mm512_slli_epi16(bits, 2), two));
        w[4 * u + 2] = _mm512_or_si512(w[4 * u + 2], _mm512_and_si512(bits, two));
        w[4 * u + 3] = _mm512_or_si512(w[4 * u + 3], _mm512_and_si512(_mm512_srli_epi16(bits, 2), two));
      }
    }
    if constexpr (fifth_bits(K)) {
      const __m512i sixteen = _mm512_set1_epi8(16);
      for (int t = 0; t < 8; ++t) {
        uint64_t bits;
        std::memcpy(&bits, record + 256 + 8 * t, 8);
        w[t] = _mm512_mask_add_epi8(w[t], _cvtu64_mask64(bits), w[t], sixteen);
      }
    }
  }
}

// sum + w . (q's 4 bytes in every lane): vpdpbusd with its memory operand broadcast in the instruction (the
// compiler would issue a separate broadcast, which measured a third slower at 8 rows).
inline __m512i dot4(__m512i sum, __m512i w, const int8_t* q) {
  asm("vpdpbusd %2%{1to16%}, %1, %0" : "+v"(sum) : "v"(w), "m"(*reinterpret_cast<const int32_t*>(q)));
  return sum;
}

// A record's 16 bytes of per-output scales -> 16 int32 (Q6_K's signed; Q4_K's and Q5_K's unsigned).
template <Kind K>
inline __m512i bytes16(const uint8_t* at) {
  const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(at));
  if constexpr (K == Kind::Q6_K) return _mm512_cvtepi8_epi32(raw);
  return _mm512_cvtepu8_epi32(raw);
}

// Rows [row, row + R) x record `group`: every block in order, each row's sums in registers.
template <Kind K, int R>
void tile(const Problem& p, int64_t row, int64_t group) {
  constexpr int64_t bytes = record_bytes(K), count = record_scales(K), per = scale_blocks(K);
  __m512 acc[R];
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  const uint8_t* codes = p.codes + group * p.kb * bytes;
  const uint16_t* scales = p.scales + group * (p.kb / per) * count;
#pragma GCC unroll 1
  for (int64_t b = 0; b < p.kb; ++b) {
    __m512i w[8];
    const uint8_t* record = codes + b * bytes;
    unpack<K>(record, w);
    const uint16_t* at = scales + b / per * count;
    __m512 dw = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(at)));
    __m512 mw = dw;
    if constexpr (has_min(K))
      mw = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(at + 16)));
    if constexpr (sub_scales(K)) {  // d * sc_j and dmin * m_j: exact
      dw = _mm512_mul_ps(dw, _mm512_cvtepi32_ps(bytes16<K>(record + bytes - 32)));
      mw = _mm512_mul_ps(mw, _mm512_cvtepi32_ps(bytes16<K>(record + bytes - 16)));
    }
    __m512i first = _mm512_setzero_si512(), second = first;
    if constexpr (K == Kind::Q6_K) {
      first = bytes16<K>(record + 384);
      second = bytes16<K>(record + 400);
    }
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r) {
      const int64_t at = b * p.n + row + r;
      const int8_t* q = p.qx + at * 32;
      __m512i sum;
      if constexpr (K == Kind::Q6_K) {  // each half's exact dot times its scale
        __m512i low = _mm512_set1_epi32(p.halves[2 * at]), high = _mm512_set1_epi32(p.halves[2 * at + 1]);
#pragma GCC unroll 4
        for (int t = 0; t < 4; ++t) {
          low = dot4(low, w[t], q + 4 * t);
          high = dot4(high, w[t + 4], q + 16 + 4 * t);
        }
        sum = _mm512_add_epi32(_mm512_mullo_epi32(low, first), _mm512_mullo_epi32(high, second));
      } else if constexpr (R == 1) {  // one row: two chains of dot products (more rows: the rows are the chains)
        sum = _mm512_set1_epi32(p.start[at]);
        __m512i odd = _mm512_setzero_si512();
#pragma GCC unroll 8
        for (int t = 0; t < 8; t += 2) {
          sum = dot4(sum, w[t], q + 4 * t);
          odd = dot4(odd, w[t + 1], q + 4 * t + 4);
        }
        sum = _mm512_add_epi32(sum, odd);
      } else {
        sum = _mm512_set1_epi32(p.start[at]);
#pragma GCC unroll 8
        for (int t = 0; t < 8; ++t) sum = dot4(sum, w[t], q + 4 * t);
      }
      acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum), _mm512_mul_ps(dw, _mm512_set1_ps(p.dx[at])), acc[r]);
      if constexpr (K == Kind::Q4_1) acc[r] = _mm512_fmadd_ps(mw, _mm512_set1_ps(p.ds[at]), acc[r]);
      if constexpr (sub_scales(K)) acc[r] = _mm512_fnmadd_ps(mw, _mm512_set1_ps(p.ds[at]), acc[r]);
    }
  }
  const int64_t col = group * 16;
  const __mmask16 mask = col + 16 <= p.m ? __mmask16(0xFFFF) : __mmask16((1u << (p.m - col)) - 1);
  const __m512 bias = p.bias != nullptr ? _mm512_maskz_loadu_ps(mask, p.bias + col) : _mm512_setzero_ps();
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r) {
    if (p.bias != nullptr) acc[r] = _mm512_add_ps(acc[r], bias);
    if (p.f32 != nullptr) _mm512_mask_storeu_ps(p.f32 + (row + r) * p.m + col, mask, acc[r]);
    else _mm256_mask_storeu_epi16(p.bf16 + (row + r) * p.m + col, mask, (__m256i)_mm512_cvtneps_pbh(acc[r]));
  }
}

using TileFn = void (*)(const Problem&, int64_t, int64_t);

template <Kind K>
TileFn tile_fn(int64_t rows) {
  switch (rows) {
    case 1: return tile<K, 1>;
    case 2: return tile<K, 2>;
    case 3: return tile<K, 3>;
    case 4: return tile<K, 4>;
    case 5: return tile<K, 5>;
    case 6: return tile<K, 6>;
    case 7: return tile<K, 7>;
    default: return tile<K, 8>;
  }
}

template <Kind K>
void records(const Problem& p, int64_t begin, int64_t end) {
  const int64_t tiles = (p.n + kTileRows - 1) / kTileRows;
  for (int64_t group = begin; group < end; ++group) {
    int64_t row = 0;
    for (int64_t t = 0; t < tiles; ++t) {  // rows split evenly over the tiles: 12 rows are 6 + 6
      const int64_t rows = (p.n - row + tiles - t - 1) / (tiles - t);
      tile_fn<K>(rows)(p, row, group);
      row += rows;
    }
  }
}

}  // namespace

void mtplm::quant::vnni_groups(const Problem& p, int64_t begin, int64_t end) {
  switch (p.kind) {
    case Kind::Q8_0: return records<Kind::Q8_0>(p, begin, end);
    case Kind::Q4_0: return records<Kind::Q4_0>(p, begin, end);
    case Kind::Q4_1: return records<Kind::Q4_1>(p, begin, end);
    case Kind::Q5_0: return records<Kind::Q5_0>(p, begin, end);
    case Kind::Q4_K: return records<Kind::Q4_K>(p, begin, end);
    case Kind::Q5_K: return records<Kind::Q5_K>(p, begin, end);
    case Kind::Q6_K: return records<Kind::Q6_K>(p, begin, end);
  }
}

#pragma GCC pop_options
