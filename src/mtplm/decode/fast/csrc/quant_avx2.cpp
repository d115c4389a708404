// quant.cpp's products on AVX2 (every build; quant.cpp states the math and the record layout).
//
// An AVX2 vector is half a record's vector: 8 outputs x 4 inputs. vpmaddubsw multiplies the unsigned codes
// by a row's signed int8 inputs into int16 pair sums, vpmaddwd adds the pairs into int32: exact while the
// int16 sums stay in range, so 4-bit codes (<= 15 x 127 x 2 a lane) add 8 vectors in int16 before one
// vpmaddwd, Q5_0's 5-bit codes 4, and Q8_0's signed codes go one at a time by the sign trick (|q| unsigned,
// q's sign moved onto the input: <= 128 x 127 x 2). Q4_K's codes go as Q4_0's and Q5_K's as Q5_0's (4 vectors,
// <= 4 x 31 x 127 x 2); Q6_K's (u - 32, signed) go by the sign trick too, 4 vectors (a half of 16 inputs) in
// int16 (<= 4 x 32 x 127 x 2), then vpmaddwd by the half's int8 scale in both int16 of each lane: the integer
// sc_0 dot_0 + sc_1 dot_1. The integer dots are the VNNI kernel's, and so, the fmas being the same, are the
// results: every ISA gives the same bits. A half-record's codes are unpacked once per block for a tile of up
// to 4 rows; more rows, and the record's other half, read them again from cache.

#include "quant.h"

#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

#define MTPLM_AVX2 __attribute__((target("avx2,fma,f16c")))

namespace {

using mtplm::quant::Kind;
using mtplm::quant::Problem;
using mtplm::quant::fifth_bits;
using mtplm::quant::has_min;
using mtplm::quant::record_bytes;
using mtplm::quant::record_scales;
using mtplm::quant::scale_blocks;
using mtplm::quant::sub_scales;
constexpr int kTileRows = 4;  // rows whose sums share the registers

MTPLM_AVX2 inline __m256i broadcast4(const int8_t* q) {
  int32_t four;
  std::memcpy(&four, q, 4);
  return _mm256_set1_epi32(four);
}

// Q5_0, Q5_K: 32 bits of a record's mask (bit k: byte k of the half-vector) -> 16 in the bytes whose bit is
// set.
MTPLM_AVX2 inline __m256i fifth(const uint8_t* mask) {
  uint32_t bits;
  std::memcpy(&bits, mask, 4);
  const __m256i spread = _mm256_shuffle_epi8(
      _mm256_set1_epi32(static_cast<int32_t>(bits)),
      _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3));
  const __m256i select = _mm256_set1_epi64x(static_cast<int64_t>(0x8040201008040201ULL));
  return _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(spread, select), select), _mm256_set1_epi8(16));
}

// Keeps v in a register as it stands here. Without it the compiler re-associates a row's chain of int16 sums
// into a tree over the whole block, whose terms, all live at once, spill out of AVX2's 16 registers.
MTPLM_AVX2 inline void pin(__m256i& v) { asm("" : "+x"(v)); }

// Rows [row, row + R) x one block's half record at `record` (half h): each row's exact int32 dots from
// their start (-offset x s_x; Q8_0's signed codes need none here).
template <Kind K, int R>
MTPLM_AVX2 inline void dots(const Problem& p, int64_t row, int64_t b, const uint8_t* record, int h, __m256i (&s)[R]) {
  const __m256i ones = _mm256_set1_epi16(1);
  const int8_t* q[R];
  for (int r = 0; r < R; ++r) q[r] = p.qx + (b * p.n + row + r) * 32;
  if constexpr (K == Kind::Q8_0) {
    for (int r = 0; r < R; ++r) s[r] = _mm256_set1_epi32(p.start[b * p.n + row + r]);
    for (int t = 0; t < 8; ++t) {
      const __m256i w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(record + 64 * t + 32 * h));
      const __m256i magnitude = _mm256_abs_epi8(w);
      for (int r = 0; r < R; ++r) {
        const __m256i pairs = _mm256_maddubs_epi16(magnitude, _mm256_sign_epi8(broadcast4(q[r] + 4 * t), w));
        s[r] = _mm256_add_epi32(s[r], _mm256_madd_epi16(pairs, ones));
        pin(s[r]);
      }
    }
  } else if constexpr (K == Kind::Q6_K) {
    const __m256i nibble = _mm256_set1_epi8(15), two = _mm256_set1_epi8(0x30), offset = _mm256_set1_epi8(32);
    const __m256i bits[2] = {_mm256_loadu_si256(reinterpret_cast<const __m256i*>(record + 256 + 32 * h)),
                             _mm256_loadu_si256(reinterpret_cast<const __m256i*>(record + 320 + 32 * h))};
    __m256i half[2][R];
    for (int r = 0; r < R; ++r) half[0][r] = half[1][r] = _mm256_setzero_si256();
    for (int v = 0; v < 4; ++v) {
      const __m256i bytes = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(record + 64 * v + 32 * h));
      const __m256i nibbles[2] = {_mm256_and_si256(bytes, nibble),
                                  _mm256_and_si256(_mm256_srli_epi16(bytes, 4), nibble)};
      for (int u = 0; u < 2; ++u) {  // input 16u + 4v + j: nibble u of vector v, bits 2v of high vector u
        const __m256i top = v == 0 ? _mm256_slli_epi16(bits[u], 4) : v == 1 ? _mm256_slli_epi16(bits[u], 2)
                          : v == 2 ? bits[u] : _mm256_srli_epi16(bits[u], 2);
        const __m256i w = _mm256_sub_epi8(_mm256_or_si256(nibbles[u], _mm256_and_si256(top, two)), offset);
        const __m256i magnitude = _mm256_abs_epi8(w);
        for (int r = 0; r < R; ++r) {
          const __m256i x = _mm256_sign_epi8(broadcast4(q[r] + 16 * u + 4 * v), w);
          half[u][r] = _mm256_add_epi16(half[u][r], _mm256_maddubs_epi16(magnitude, x));
          pin(half[u][r]);
        }
      }
    }
    __m256i scale[2];
    for (int u = 0; u < 2; ++u) {  // the half's int8 scale in both int16 of its output's lane
      int64_t eight;
      std::memcpy(&eight, record + 384 + 16 * u + 8 * h, 8);
      const __m256i wide = _mm256_cvtepi8_epi32(_mm_cvtsi64_si128(eight));
      scale[u] = _mm256_or_si256(_mm256_and_si256(wide, _mm256_set1_epi32(0xFFFF)), _mm256_slli_epi32(wide, 16));
    }
    for (int r = 0; r < R; ++r)
      s[r] = _mm256_add_epi32(_mm256_madd_epi16(half[0][r], scale[0]), _mm256_madd_epi16(half[1][r], scale[1]));
  } else {
    const __m256i nibble = _mm256_set1_epi8(15);
    __m256i wide[R];
    for (int r = 0; r < R; ++r) wide[r] = _mm256_set1_epi32(p.start[b * p.n + row + r]);
    __m256i narrow[R];
    for (int r = 0; r < R; ++r) narrow[r] = _mm256_setzero_si256();
    for (int v = 0; v < 4; ++v) {
      const __m256i bytes = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(record + 64 * v + 32 * h));
      __m256i low = _mm256_and_si256(bytes, nibble), high = _mm256_and_si256(_mm256_srli_epi16(bytes, 4), nibble);
      if constexpr (fifth_bits(K)) {
        low = _mm256_or_si256(low, fifth(record + 256 + 8 * v + 4 * h));
        high = _mm256_or_si256(high, fifth(record + 256 + 8 * (v + 4) + 4 * h));
      }
      for (int r = 0; r < R; ++r) {
        const __m256i both = _mm256_add_epi16(_mm256_maddubs_epi16(low, broadcast4(q[r] + 4 * v)),
                                              _mm256_maddubs_epi16(high, broadcast4(q[r] + 16 + 4 * v)));
        narrow[r] = _mm256_add_epi16(narrow[r], both);
        pin(narrow[r]);
      }
      if (fifth_bits(K) ? v % 2 == 1 : v == 3) {  // int16 sums flushed before they could overflow
        for (int r = 0; r < R; ++r) {
          wide[r] = _mm256_add_epi32(wide[r], _mm256_madd_epi16(narrow[r], ones));
          narrow[r] = _mm256_setzero_si256();
        }
      }
    }
    for (int r = 0; r < R; ++r) s[r] = wide[r];
  }
}

// 8 float32 sums -> bf16 (to nearest even), `valid` of them stored.
MTPLM_AVX2 inline void store_bf16(uint16_t* y, __m256 value, int64_t valid) {
  __m256i bits = _mm256_castps_si256(value);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
  bits = _mm256_srli_epi32(_mm256_add_epi32(bits, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7FFF))), 16);
  const __m128i half = _mm_packus_epi32(_mm256_castsi256_si128(bits), _mm256_extracti128_si256(bits, 1));
  if (valid == 8) return _mm_storeu_si128(reinterpret_cast<__m128i*>(y), half);
  alignas(16) uint16_t out[8];
  _mm_store_si128(reinterpret_cast<__m128i*>(out), half);
  std::memcpy(y, out, valid * 2);
}

MTPLM_AVX2 inline void store_f32(float* y, __m256 value, int64_t valid) {
  if (valid == 8) return _mm256_storeu_ps(y, value);
  alignas(32) float out[8];
  _mm256_store_ps(out, value);
  std::memcpy(y, out, valid * 4);
}

// 8 bytes of a record's per-output scales -> 8 float32 (Q4_K's or Q5_K's sc_j or m_j).
MTPLM_AVX2 inline __m256 bytes8(const uint8_t* at) {
  int64_t eight;
  std::memcpy(&eight, at, 8);
  return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_cvtsi64_si128(eight)));
}

// Lines of a record to fetch into cache while a tile runs: block b's lines at offsets from, from + step, ..
// (and its last byte) of `codes` + b x its record bytes; none where `codes` is null.
struct Fetch {
  const uint8_t* codes = nullptr;
  int from = 0, step = 64;
};

// Rows [row, row + R) x half h (outputs 8h .. 8h + 7) of record `group`: every block in order.
template <Kind K, int R>
MTPLM_AVX2 void tile(const Problem& p, int64_t row, int64_t group, int h, Fetch fetch) {
  constexpr int64_t bytes = record_bytes(K), count = record_scales(K), per = scale_blocks(K);
  __m256 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
  const uint8_t* codes = p.codes + group * p.kb * bytes;
  const uint16_t* scales = p.scales + group * (p.kb / per) * count + 8 * h;
  for (int64_t b = 0; b < p.kb; ++b) {
    __m256i s[R];
    const uint8_t* record = codes + b * bytes;
    if (fetch.codes != nullptr) {
      const char* next = reinterpret_cast<const char*>(fetch.codes + b * bytes);
      for (int64_t at = fetch.from; at < bytes; at += fetch.step) _mm_prefetch(next + at, _MM_HINT_T0);
      _mm_prefetch(next + bytes - 1, _MM_HINT_T0);
    }
    dots<K, R>(p, row, b, record, h, s);
    const uint16_t* at = scales + b / per * count;
    __m256 dw = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(at))), mw = dw;
    if constexpr (has_min(K)) mw = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(at + 16)));
    if constexpr (sub_scales(K)) {  // d * sc_j and dmin * m_j: exact
      dw = _mm256_mul_ps(dw, bytes8(record + bytes - 32 + 8 * h));
      mw = _mm256_mul_ps(mw, bytes8(record + bytes - 16 + 8 * h));
    }
    for (int r = 0; r < R; ++r) {
      const float d = p.dx[b * p.n + row + r];
      acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s[r]), _mm256_mul_ps(dw, _mm256_set1_ps(d)), acc[r]);
      if constexpr (K == Kind::Q4_1) acc[r] = _mm256_fmadd_ps(mw, _mm256_set1_ps(p.ds[b * p.n + row + r]), acc[r]);
      if constexpr (sub_scales(K)) acc[r] = _mm256_fnmadd_ps(mw, _mm256_set1_ps(p.ds[b * p.n + row + r]), acc[r]);
    }
  }
  const int64_t col = group * 16 + 8 * h, valid = std::min<int64_t>(8, p.m - col);
  if (p.bias != nullptr) {
    alignas(32) float bias[8] = {};
    std::memcpy(bias, p.bias + col, valid * 4);
    for (int r = 0; r < R; ++r) acc[r] = _mm256_add_ps(acc[r], _mm256_load_ps(bias));
  }
  for (int r = 0; r < R; ++r) {
    if (p.f32 != nullptr) store_f32(p.f32 + (row + r) * p.m + col, acc[r], valid);
    else store_bf16(p.bf16 + (row + r) * p.m + col, acc[r], valid);
  }
}

using TileFn = void (*)(const Problem&, int64_t, int64_t, int, Fetch);

template <Kind K>
TileFn tile_fn(int64_t rows) {
  switch (rows) {
    case 1: return tile<K, 1>;
    case 2: return tile<K, 2>;
    case 3: return tile<K, 3>;
    default: return tile<K, 4>;
  }
}

// Records [begin, end), each half by tiles of rows. One row's products barely outrun the memory, and a record's
// second half reads its codes from cache, where the memory would idle: so while record g's halves run, the
// first tile of each fetches record g + 1's codes, half of their lines each (all of them where g has one
// half). Measured on a 2-vCPU AMD EPYC Zen 3, 1 and 2 rows over Qwen2.5-1.5B's projections (Q4_K, Q6_K) and
// head (Q6_K) took 0.71-0.93x the time they took without (docs/kernels.md); the results are the same bits.
template <Kind K>
void records(const Problem& p, int64_t begin, int64_t end) {
  const int64_t tiles = (p.n + kTileRows - 1) / kTileRows, bytes = record_bytes(K);
  for (int64_t group = begin; group < end; ++group) {
    for (int h = 0; h < 2 && group * 16 + 8 * h < p.m; ++h) {
      const bool both = group * 16 + 8 < p.m;  // the record has a second half
      Fetch fetch;
      if (group + 1 < end) fetch = {p.codes + (group + 1) * p.kb * bytes, both ? 64 * h : 0, both ? 128 : 64};
      int64_t row = 0;
      for (int64_t t = 0; t < tiles; ++t) {  // rows split evenly over the tiles
        const int64_t rows = (p.n - row + tiles - t - 1) / (tiles - t);
        tile_fn<K>(rows)(p, row, group, h, t == 0 ? fetch : Fetch{});
        row += rows;
      }
    }
  }
}

}  // namespace

void mtplm::quant::avx2_groups(const Problem& p, int64_t begin, int64_t end) {
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
