// The few-row products on AVX-512 with bf16 dot products (vdpbf16ps): what a CPU without AMX runs in the
// AVX-512 build (fewrow.cpp states the problem and the packed layout).
//
// For each block of 16 outputs, each pair of inputs is 64 contiguous bytes, so one vdpbf16ps per row (the
// row's input pair broadcast) adds 16 outputs' partial sums with no horizontal reduction. A group of up to 4
// output blocks is streamed from memory once and held in L1/L2 while every tile of up to 6 rows reads it
// (all of a tile's accumulators live in registers). Any row count (a prompt's chunk too): at the L2-resident
// group the products run near the core's bf16 peak (measured on a Zen 4 at 64-256 rows: at par with oneDNN
// over an unpacked weight, which would cost a copy of it per call).

#include "bf16_avx512.h"
#include "fewrow.h"

#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

namespace {

using mtplm::fewrow::kBlock;  // outputs per vdpbf16ps
using mtplm::fewrow::load_bias;
using mtplm::fewrow::Problem;
using mtplm::fewrow::store_row;
constexpr int kGroup = 4;     // output blocks streamed together
constexpr int kTileRows = 6;  // rows whose accumulators share the registers

// acc += rows [0, R) of x (row stride xs) over input pairs [k0, k1) of output blocks [0, B) of w (`pairs`
// pairs a block); x's column 0 is input pair k0.
template <int R, int B>
inline void accumulate(__m512 (&acc)[R][B], const uint16_t* w, int64_t pairs, int64_t k0, int64_t k1,
                       const uint16_t* x, int64_t xs) {
  for (int64_t k = k0; k < k1; ++k) {
    __m512bh wv[B];
    for (int b = 0; b < B; ++b)
      wv[b] = (__m512bh)_mm512_loadu_si512(w + (b * pairs + k) * 2 * kBlock);
    for (int r = 0; r < R; ++r) {
      int32_t pair;
      std::memcpy(&pair, x + r * xs + 2 * (k - k0), sizeof(pair));
      __m512bh xv = (__m512bh)_mm512_set1_epi32(pair);
      for (int b = 0; b < B; ++b) acc[r][b] = _mm512_dpbf16_ps(acc[r][b], xv, wv[b]);
    }
  }
}

// Rows [row, row + R) x output blocks [block, block + B): the whole K loop with R * B accumulators.
template <int R, int B>
void tile(const Problem& p, int64_t row, int64_t block) {
  __m512 acc[R][B];
  for (int r = 0; r < R; ++r)
    for (int b = 0; b < B; ++b) acc[r][b] = _mm512_setzero_ps();
  const uint16_t* w = p.w + (block - p.first) * p.kp * kBlock;
  const int64_t pairs = p.kp / 2, main = p.tail != nullptr ? p.ktail / 2 : pairs;
  accumulate<R, B>(acc, w, pairs, 0, main, p.x + row * p.xs, p.xs);
  if (p.tail != nullptr) accumulate<R, B>(acc, w, pairs, main, pairs, p.tail + row * p.ts, p.ts);
  for (int b = 0; b < B; ++b) {
    const int64_t col = (block + b) * kBlock;
    if (p.f32 != nullptr) {
      for (int r = 0; r < R; ++r) _mm512_storeu_ps(p.f32 + (row + r) * p.m + col, acc[r][b]);
      continue;
    }
    const __m512 bias = load_bias(p.bias, col, p.m);
    for (int r = 0; r < R; ++r) store_row(p.y + (row + r) * p.m, col, p.m, _mm512_add_ps(acc[r][b], bias));
  }
}

using TileFn = void (*)(const Problem&, int64_t, int64_t);

template <int R>
constexpr TileFn pick(int blocks) {
  return blocks == 1 ? tile<R, 1> : blocks == 2 ? tile<R, 2> : blocks == 3 ? tile<R, 3> : tile<R, 4>;
}

TileFn tile_fn(int rows, int blocks) {
  switch (rows) {
    case 1: return pick<1>(blocks);
    case 2: return pick<2>(blocks);
    case 3: return pick<3>(blocks);
    case 4: return pick<4>(blocks);
    case 5: return pick<5>(blocks);
    default: return pick<6>(blocks);
  }
}

}  // namespace

// Output blocks [begin, end): groups of up to kGroup blocks, each read by every row tile in turn.
void mtplm::fewrow::avx512_blocks(const Problem& p, int64_t begin, int64_t end) {
  const int64_t tiles = (p.n + kTileRows - 1) / kTileRows;
  for (int64_t block = begin; block < end; block += kGroup) {
    const int blocks = static_cast<int>(std::min<int64_t>(kGroup, end - block));
    int64_t row = 0;
    for (int64_t t = 0; t < tiles; ++t) {  // rows split evenly over the tiles: 8 rows are 4 + 4
      const int64_t rows = (p.n - row) / (tiles - t) + ((p.n - row) % (tiles - t) != 0);
      tile_fn(static_cast<int>(rows), blocks)(p, row, block);
      row += rows;
    }
  }
}
