// The few-row products in AMX tiles, where the CPU has them (AVX-512 build). pack()'s layout is already
// AMX's B-tile layout (16 input pairs x 16 outputs x 2 = one 1 KB tile per 32 inputs of a block). Tiles: 0, 1
// the inputs (rows 0-15, 16-31), 2, 3 two output blocks' weights, 4-7 the accumulators (row tile x output
// block). The rows go in 32-row chunks.

#include "bf16_avx512.h"
#include "fewrow.h"

#include <cpuid.h>
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <cstdint>

namespace {

using mtplm::fewrow::kBlock;
using mtplm::fewrow::load_bias;
using mtplm::fewrow::Problem;
using mtplm::fewrow::store_row;
using mtplm::fewrow::TileConfig;

__attribute__((target("amx-tile,amx-bf16,avx512f,avx512bw,avx512vl,avx512bf16")))
void amx_store(const Problem& p, int tile, int64_t row, int rows, int64_t block, float* scratch) {
  if (tile == 4) _tile_stored(4, scratch, 64);
  else if (tile == 5) _tile_stored(5, scratch, 64);
  else if (tile == 6) _tile_stored(6, scratch, 64);
  else _tile_stored(7, scratch, 64);
  const int64_t col = block * kBlock;
  if (p.f32 != nullptr) {  // float32 sums, as the register tiles store them
    for (int r = 0; r < rows; ++r) _mm512_storeu_ps(p.f32 + (row + r) * p.m + col, _mm512_load_ps(scratch + r * kBlock));
    return;
  }
  const __m512 bias = load_bias(p.bias, col, p.m);
  for (int r = 0; r < rows; ++r)
    store_row(p.y + (row + r) * p.m, col, p.m, _mm512_add_ps(_mm512_load_ps(scratch + r * kBlock), bias));
}

// The tile products of one 32-input chunk: x rows 0-15 (and 16-31: Wide) at x, `stride` bytes apart, against
// the chunk of output block w0 (and w1: Two).
template <bool Wide, bool Two>
__attribute__((target("amx-tile,amx-bf16"), always_inline)) inline void amx_chunk(const uint16_t* x, int64_t stride,
                                                                                const uint16_t* w0,
                                                                                const uint16_t* w1) {
  _tile_loadd(0, x, stride);
  _tile_loadd(2, w0, 64);
  if (Wide) _tile_loadd(1, x + 8 * stride, stride);  // 16 rows on: 16 * stride bytes
  _tile_dpbf16ps(4, 0, 2);
  if (Wide) _tile_dpbf16ps(6, 1, 2);
  if (Two) {
    _tile_loadd(3, w1, 64);
    _tile_dpbf16ps(5, 0, 3);
    if (Wide) _tile_dpbf16ps(7, 1, 3);
  }
}

// Rows [row, row + rows) (rows <= 32, as the tile config says) x output blocks block (and block + 1: Two).
template <bool Wide, bool Two>
__attribute__((target("amx-tile,amx-bf16,avx512f,avx512bw,avx512vl,avx512bf16")))
void amx_pair(const Problem& p, int64_t row, int rows, int64_t block, float* scratch) {
  _tile_zero(4);
  if (Two) _tile_zero(5);
  if (Wide) _tile_zero(6);
  if (Wide && Two) _tile_zero(7);
  const int64_t per_block = p.kp * kBlock, main = p.tail != nullptr ? p.ktail : p.kp;
  const uint16_t* w0 = p.w + (block - p.first) * per_block;
  const uint16_t* x = p.x + row * p.xs;
  for (int64_t k = 0; k < main; k += 32)
    amx_chunk<Wide, Two>(x + k, p.xs * 2, w0 + k * kBlock, w0 + per_block + k * kBlock);
  for (int64_t k = main; k < p.kp; k += 32)  // the tail's columns (none without one)
    amx_chunk<Wide, Two>(p.tail + row * p.ts + (k - main), p.ts * 2, w0 + k * kBlock, w0 + per_block + k * kBlock);
  const int top = std::min(rows, 16), bottom = rows - top;
  amx_store(p, 4, row, top, block, scratch);
  if (Two) amx_store(p, 5, row, top, block + 1, scratch);
  if (Wide) amx_store(p, 6, row + 16, bottom, block, scratch);
  if (Wide && Two) amx_store(p, 7, row + 16, bottom, block + 1, scratch);
}

__attribute__((target("amx-tile,amx-bf16")))
void amx_configure(int rows) {
  const uint8_t top = static_cast<uint8_t>(std::min(rows, 16)), bottom = static_cast<uint8_t>(rows - top);
  TileConfig config{};
  config.palette = 1;
  for (int t = 0; t < 8; ++t) {
    const bool lower = t == 1 || t >= 6;
    config.rows[t] = t == 2 || t == 3 ? 16 : lower ? bottom : top;
    config.colsb[t] = config.rows[t] ? 64 : 0;
  }
  // GCC's _tile_loadconfig names only the config's first 8 bytes as its operand: without this barrier the
  // stores to the rest can be dropped as dead (an invalid config, a fault)
  asm volatile("" : : "r"(&config) : "memory");
  _tile_loadconfig(&config);
}

// Rows [row, row + rows) in chunks of `chunk` (<= 32) rows, output blocks [begin, end) two at a time; each
// pair of blocks' weights is read from memory once and from cache by every chunk.
void amx_rows(const Problem& p, int64_t row, int64_t rows, int chunk, int64_t begin, int64_t end) {
  amx_configure(chunk);
  alignas(64) float scratch[16 * kBlock];
  for (int64_t block = begin; block < end; block += 2) {
    const bool two = block + 1 < end;
    for (int64_t r = row; r < row + rows; r += chunk) {
      if (chunk > 16) two ? amx_pair<true, true>(p, r, chunk, block, scratch)
                          : amx_pair<true, false>(p, r, chunk, block, scratch);
      else two ? amx_pair<false, true>(p, r, chunk, block, scratch)
               : amx_pair<false, false>(p, r, chunk, block, scratch);
    }
  }
}

}  // namespace

// Any number of rows: whole 32-row chunks, then the rest (a second tile config, the weights read again).
__attribute__((target("amx-tile,amx-bf16")))
void mtplm::fewrow::amx_blocks(const Problem& p, int64_t begin, int64_t end) {
  const int64_t whole = p.n / 32 * 32;
  if (whole > 0) amx_rows(p, 0, whole, 32, begin, end);
  if (p.n > whole) amx_rows(p, whole, p.n - whole, static_cast<int>(p.n - whole), begin, end);
  _tile_release();
}

bool mtplm::fewrow::amx_usable() {
  unsigned a, b, c, d;
  if (!__get_cpuid_count(7, 0, &a, &b, &c, &d)) return false;
  if (!((d >> 22) & 1) || !((d >> 24) & 1)) return false;  // AMX-BF16, AMX-TILE
  constexpr long kReqPerm = 0x1023, kTileData = 18;  // ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA
  return syscall(SYS_arch_prctl, kReqPerm, kTileData) == 0;
}

void mtplm::fewrow::configure_tiles(int rows) { amx_configure(rows); }

void mtplm::fewrow::store_tile(const Problem& p, int tile, int64_t row, int rows, int64_t block, float* scratch) {
  amx_store(p, tile, row, rows, block, scratch);
}
