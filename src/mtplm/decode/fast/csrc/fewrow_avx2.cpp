// The few-row products on AVX2 + FMA, for CPUs without AVX-512 bf16 (most laptops and desktops), and for
// any build where use_isa("avx2") asks for them (fewrow.cpp states the problem and the packed layout).
//
// The packed weights stay bf16 in memory (the bytes a memory-bound pass reads); a 256-bit load holds 8
// outputs' input pairs, one per 32-bit lane, and two integer ops make float32 of them: the lane shifted
// left 16 bits is input 2i's weight, the lane with its low half cleared is input 2i + 1's. The rows are
// widened to float32 once a call; each row's two inputs are broadcast, and two FMAs per half-block add the
// pair to 8 outputs' sums. So an output's sum runs over the inputs in index order, one FMA each, whatever
// the rows: a row's results do not depend on the rows beside it. A group of 4 output blocks is streamed once
// while every tile of up to 4 rows reads it from cache. Sums are float32 like the other kernels', but not
// bitwise theirs (vdpbf16ps and AMX round their pairs otherwise): each ISA is lossless against itself.

#include "fewrow.h"

#include <c10/util/BFloat16.h>

#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <utility>
#include <vector>

#define MTPLM_AVX2 __attribute__((target("avx2,fma")))

namespace {

using mtplm::fewrow::kBlock;
using mtplm::fewrow::Problem;
constexpr int kGroup = 4;     // output blocks streamed together
constexpr int64_t kGroupBytes = 256 << 10;  // at most this much of them while several row tiles read them
constexpr int kTileRows = 4;  // rows whose accumulators share the registers

// bf16 pairs (one per 32-bit lane) -> float32 of the low halves (the even inputs) and of the high halves
MTPLM_AVX2 inline __m256 even_half(__m256i pairs) { return _mm256_castsi256_ps(_mm256_slli_epi32(pairs, 16)); }
MTPLM_AVX2 inline __m256 odd_half(__m256i pairs) {
  return _mm256_castsi256_ps(_mm256_and_si256(pairs, _mm256_set1_epi32(static_cast<int>(0xFFFF0000u))));
}

// acc += rows [0, R) of x (float32, row stride xs) over the input pairs [0, pairs) of B blocks from w.
// acc[r][h]: row r's outputs 8h .. 8h + 7 of the blocks. Every output's sum is one chain of FMAs, two a pair;
// R x 2B chains hide the FMA's latency (one row alone reads 4 blocks at once: 8 chains).
template <int R, int B>
MTPLM_AVX2 inline void accumulate(__m256 (&acc)[R][2 * B], const uint16_t* w, int64_t pairs, const float* x,
                                  int64_t xs) {
  for (int64_t k = 0; k < pairs; ++k) {
    for (int h = 0; h < 2 * B; ++h) {
      const uint16_t* half = w + (h / 2 * pairs + k) * 2 * kBlock + h % 2 * kBlock;
      const __m256i both = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(half));
      const __m256 even_w = even_half(both), odd_w = odd_half(both);
      for (int r = 0; r < R; ++r) {
        acc[r][h] = _mm256_fmadd_ps(_mm256_broadcast_ss(x + r * xs + 2 * k), even_w, acc[r][h]);
        acc[r][h] = _mm256_fmadd_ps(_mm256_broadcast_ss(x + r * xs + 2 * k + 1), odd_w, acc[r][h]);
      }
    }
  }
}

// The rows of p as float32 [n, kp] (exact): x's columns, then the tail's, in this thread's buffer (reused by
// its next call: no allocation per product). Broadcasting a float32 is a load; a bf16 pair would cost the
// FMA ports a shift and a mask for every row at every pair.
MTPLM_AVX2 const std::vector<float>& widened(const Problem& p) {
  thread_local std::vector<float> wide;
  wide.resize(p.n * p.kp);
  const int64_t main = p.tail != nullptr ? p.ktail : p.kp;
  for (int64_t r = 0; r < p.n; ++r) {
    float* to = wide.data() + r * p.kp;
    for (int64_t e = 0; e < p.kp; e += 8) {
      const uint16_t* from = e < main ? p.x + r * p.xs + e : p.tail + r * p.ts + (e - main);
      const __m128i half = _mm_loadu_si128(reinterpret_cast<const __m128i*>(from));
      _mm256_storeu_ps(to + e, _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(half), 16)));
    }
  }
  return wide;
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

// Rows [row, row + R) x output blocks [block, block + B): the whole K loop.
template <int R, int B>
MTPLM_AVX2 void tile(const Problem& p, const float* wide, int64_t row, int64_t block) {
  __m256 acc[R][2 * B];
  for (int r = 0; r < R; ++r)
    for (int h = 0; h < 2 * B; ++h) acc[r][h] = _mm256_setzero_ps();
  accumulate<R, B>(acc, p.w + (block - p.first) * p.kp * kBlock, p.kp / 2, wide + row * p.kp, p.kp);
  for (int r = 0; r < R; ++r)
    for (int b = 0; b < B; ++b) store(p, row + r, block + b, {acc[r][2 * b], acc[r][2 * b + 1]});
}

using TileFn = void (*)(const Problem&, const float*, int64_t, int64_t);

// The tile for `rows` rows over up to `blocks` blocks, and how many blocks it takes.
std::pair<TileFn, int64_t> tile_fn(int64_t rows, int64_t blocks) {
  if (rows == 1) return blocks >= 4 ? std::make_pair(tile<1, 4>, 4) : blocks >= 2 ? std::make_pair(tile<1, 2>, 2)
                                                                                  : std::make_pair(tile<1, 1>, 1);
  if (rows == 2) return blocks >= 2 ? std::make_pair(tile<2, 2>, 2) : std::make_pair(tile<2, 1>, 1);
  return {rows == 3 ? tile<3, 1> : tile<4, 1>, 1};
}

}  // namespace

// Output blocks [begin, end): groups of up to kGroup blocks, each read by every row tile in turn.
void mtplm::fewrow::avx2_blocks(const Problem& p, int64_t begin, int64_t end) {
  const int64_t tiles = (p.n + kTileRows - 1) / kTileRows;
  const std::vector<float>& wide = widened(p);
  // a group the second row tile reads from L2, not memory (a long K's block alone can be ~300 KB)
  const int64_t fits = std::max<int64_t>(1, kGroupBytes / (p.kp * kBlock * 2));
  const int64_t size = tiles > 1 ? std::min<int64_t>(kGroup, fits) : kGroup;
  for (int64_t group = begin; group < end; group += size) {
    const int64_t last = std::min<int64_t>(group + size, end);
    int64_t row = 0;
    for (int64_t t = 0; t < tiles; ++t) {  // rows split evenly over the tiles: 6 rows are 3 + 3
      const int64_t rows = (p.n - row) / (tiles - t) + ((p.n - row) % (tiles - t) != 0);
      for (int64_t block = group; block < last;) {
        const auto [fn, blocks] = tile_fn(rows, last - block);
        fn(p, wide.data(), row, block);
        block += blocks;
      }
      row += rows;
    }
  }
}
