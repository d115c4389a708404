// The few-row products on AVX2 + FMA, for CPUs without AVX-512 bf16 (most laptops and desktops), and for
// any build where use_isa("avx2") asks for them (fewrow.cpp states the problem and the packed layout).
//
// The packed weights stay bf16 in memory (the bytes a memory-bound pass reads); a 256-bit load holds 8
// outputs' input pairs, one per 32-bit lane, and two integer ops make float32 of them: the lane shifted
// left 16 bits is input 2i's weight, the lane with its low half cleared is input 2i + 1's. The row's pair
// is broadcast and split the same way, and two FMAs per half-block add the pair to 8 outputs' sums. So an
// output's sum runs over the inputs in index order, one FMA each, whatever the rows: a row's results do not
// depend on the rows beside it. A group of 4 output blocks is streamed once while every tile of up to 4 rows
// reads it from cache (a tile's 8 accumulators, the 4 weight vectors and the row's pair fill the 16
// registers). Sums are float32 like the other kernels', but not bitwise theirs (vdpbf16ps and AMX round
// their pairs otherwise): each ISA is lossless against itself.

#include "fewrow.h"

#include <c10/util/BFloat16.h>

#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

#define MTPLM_AVX2 __attribute__((target("avx2,fma")))

namespace {

using mtplm::fewrow::kBlock;
using mtplm::fewrow::Problem;
constexpr int kGroup = 4;     // output blocks streamed together
constexpr int kTileRows = 4;  // rows whose accumulators share the registers

// bf16 pairs (one per 32-bit lane) -> float32 of the low halves (the even inputs) and of the high halves
MTPLM_AVX2 inline __m256 even_half(__m256i pairs) { return _mm256_castsi256_ps(_mm256_slli_epi32(pairs, 16)); }
MTPLM_AVX2 inline __m256 odd_half(__m256i pairs) {
  return _mm256_castsi256_ps(_mm256_and_si256(pairs, _mm256_set1_epi32(static_cast<int>(0xFFFF0000u))));
}

// acc += rows [0, R) of x (row stride xs) over input pairs [k0, k1) of the block at w; x's column 0 is
// input pair k0. acc[r][h]: row r's outputs 8h .. 8h + 7 of the block.
template <int R>
MTPLM_AVX2 inline void accumulate(__m256 (&acc)[R][2], const uint16_t* w, int64_t k0, int64_t k1,
                                  const uint16_t* x, int64_t xs) {
  for (int64_t k = k0; k < k1; ++k) {
    __m256 even_w[2], odd_w[2];
    for (int h = 0; h < 2; ++h) {
      const __m256i pairs = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + k * 2 * kBlock + h * kBlock));
      even_w[h] = even_half(pairs);
      odd_w[h] = odd_half(pairs);
    }
    for (int r = 0; r < R; ++r) {
      int32_t pair;
      std::memcpy(&pair, x + r * xs + 2 * (k - k0), sizeof(pair));
      const __m256i both = _mm256_set1_epi32(pair);
      const __m256 even = even_half(both), odd = odd_half(both);
      for (int h = 0; h < 2; ++h) {
        acc[r][h] = _mm256_fmadd_ps(even, even_w[h], acc[r][h]);
        acc[r][h] = _mm256_fmadd_ps(odd, odd_w[h], acc[r][h]);
      }
    }
  }
}

// Row `row`'s 16 sums of output block `block`: float32 as they are, or plus the bias and rounded to bf16 (to
// nearest even) for the outputs below M.
MTPLM_AVX2 void store(const Problem& p, int64_t row, int64_t block, const __m256 (&sums)[2]) {
  const int64_t col = block * kBlock;
  if (p.f32 != nullptr) {
    _mm256_storeu_ps(p.f32 + row * p.m + col, sums[0]);
    _mm256_storeu_ps(p.f32 + row * p.m + col + 8, sums[1]);
    return;
  }
  alignas(32) float lanes[kBlock];
  _mm256_store_ps(lanes, sums[0]);
  _mm256_store_ps(lanes + 8, sums[1]);
  const int64_t count = std::min<int64_t>(kBlock, p.m - col);
  for (int64_t j = 0; j < count; ++j) {
    float value = lanes[j];
    if (p.bias != nullptr) {
      const uint32_t bits = uint32_t(p.bias[col + j]) << 16;
      float bias;
      std::memcpy(&bias, &bits, sizeof(bias));
      value += bias;
    }
    const c10::BFloat16 rounded(value);
    std::memcpy(p.y + row * p.m + col + j, &rounded, 2);
  }
}

// Rows [row, row + R) x output block `block`: the whole K loop (x's columns, then the tail's).
template <int R>
MTPLM_AVX2 void tile(const Problem& p, int64_t row, int64_t block) {
  __m256 acc[R][2];
  for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
  const uint16_t* w = p.w + (block - p.first) * p.kp * kBlock;
  const int64_t pairs = p.kp / 2, main = p.tail != nullptr ? p.ktail / 2 : pairs;
  accumulate<R>(acc, w, 0, main, p.x + row * p.xs, p.xs);
  if (p.tail != nullptr) accumulate<R>(acc, w, main, pairs, p.tail + row * p.ts, p.ts);
  for (int r = 0; r < R; ++r) store(p, row + r, block, acc[r]);
}

using TileFn = void (*)(const Problem&, int64_t, int64_t);

TileFn tile_fn(int64_t rows) {
  return rows == 1 ? tile<1> : rows == 2 ? tile<2> : rows == 3 ? tile<3> : tile<4>;
}

}  // namespace

// Output blocks [begin, end): groups of up to kGroup blocks, each read by every row tile in turn.
void mtplm::fewrow::avx2_blocks(const Problem& p, int64_t begin, int64_t end) {
  const int64_t tiles = (p.n + kTileRows - 1) / kTileRows;
  for (int64_t group = begin; group < end; group += kGroup) {
    const int64_t last = std::min<int64_t>(group + kGroup, end);
    int64_t row = 0;
    for (int64_t t = 0; t < tiles; ++t) {  // rows split evenly over the tiles: 6 rows are 3 + 3
      const int64_t rows = (p.n - row) / (tiles - t) + ((p.n - row) % (tiles - t) != 0);
      const TileFn fn = tile_fn(rows);
      for (int64_t block = group; block < last; ++block) fn(p, row, block);
      row += rows;
    }
  }
}
