// What fewrow.cpp (the bf16 few-row products) lends the other kernels: the problem it solves, its kernels per
// ISA and the choice among them, and the AMX tile config and load barrier.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>

namespace mtplm::fewrow {

constexpr int kBlock = 16;  // outputs per vdpbf16ps, and per AMX tile column

// AMX's tile config (ldtilecfg's 64-byte operand, palette 1)
struct TileConfig {
  uint8_t palette, start_row, reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
};

// GCC's _tile_loadd names its address as a plain input, not the memory behind it: without this barrier the
// stores that fill a buffer just before a tile load from it may be moved past the load, or dropped.
inline void before_tile_loads() { asm volatile("" : : : "memory"); }

struct Problem {
  const uint16_t* x;  // [N, xs] bf16 bits, of which the first Kp are read
  const uint16_t* w;  // packed: output blocks first, first + 1, ... (pack()'s layout)
  const uint16_t* bias;  // [M] bf16 bits or null
  uint16_t* y;  // [N, M] bf16, or null where f32 takes the outputs
  int64_t n, m, kp, xs;
  float* f32 = nullptr;  // [N, M] float32 outputs instead of y (no bias; M a multiple of 16), either ISA
  int64_t first = 0;  // the output block w starts at
  // Inputs [ktail, Kp) read from `tail` instead ([N, ts] bf16 bits, its column 0 being input ktail; ktail a
  // multiple of 32): a widened product's extra columns (lora.cpp) without a joined copy of x.
  const uint16_t* tail = nullptr;
  int64_t ktail = 0, ts = 0;
};

// Output blocks [begin, end) of p on the calling thread, by the kernel isa() names (fewrow.cpp).
void products(const Problem& p, int64_t begin, int64_t end);

// The kernels products() chooses from: AVX2 + FMA (every build), AVX-512 and AMX tiles (the AVX-512 build).
void avx2_blocks(const Problem& p, int64_t begin, int64_t end);
void avx512_blocks(const Problem& p, int64_t begin, int64_t end);
void amx_blocks(const Problem& p, int64_t begin, int64_t end);
bool amx_usable();  // the CPU has AMX-BF16 and the kernel let this process use its tiles

at::Tensor pack(const at::Tensor& weight);  // W [M, K] -> pack()'s layout

// The AMX path, for a kernel with its own inner loop (int4.cpp): whether isa() says so; the tile config for
// `rows` (<= 32) rows (tiles 0, 1 rows 0-15 and 16-31, 2, 3 two blocks' weights, 4-7 the sums); accumulator
// tile 4-7 of output block `block`, rows [row, row + rows), stored with the bias (scratch: 16 x 16 floats).
bool amx();
bool avx2();  // whether isa() is AVX2 (the other kernels then take their AVX2 paths too)
void configure_tiles(int rows);
void store_tile(const Problem& p, int tile, int64_t row, int rows, int64_t block, float* scratch);

}  // namespace mtplm::fewrow
