// Few-row bf16 products at the memory bound: y[N, M] = x[N, K] @ W^T (+ bias), bf16 in and out, fp32
// accumulation, for the few rows of a decode pass and the many of a prompt (fewrow.py builds and loads this).
//
// W is packed once as [Mp / 16][Kp / 2][16][2] (Mp, Kp: M rounded up to 16, K to 32, zero padded): for
// each block of 16 outputs, each pair of inputs is 64 contiguous bytes, so one vdpbf16ps per row (the row's
// input pair broadcast) adds 16 outputs' partial sums with no horizontal reduction. A group of up to 4
// output blocks is streamed from memory once and held in L1/L2 while every tile of up to 6 rows reads it
// (all of a tile's accumulators live in registers). at::parallel_for splits the output blocks over the
// threads. Any row count (a prompt's chunk too): a group's weights stay in L2 while every row tile reads them,
// and at the L2-resident group the products run near the core's bf16 peak (measured on a Zen 4 at 64-256
// rows: at par with oneDNN over an unpacked weight, which would cost a copy of it per call). The AMX path
// (below) takes the rows in 32-row chunks.
//
// The packed tensor is presented as [M, 1, Kp] over storage of Mp * Kp elements (an opaque weight whose
// shape names the true out features; fewrow.py's fake kernel reads it).

#include "fewrow.h"

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <cpuid.h>
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <string>

namespace {

using mtplm::fewrow::kBlock;  // outputs per vdpbf16ps
using mtplm::fewrow::Problem;
using mtplm::fewrow::TileConfig;
constexpr int kGroup = 4;     // output blocks streamed together
constexpr int kTileRows = 6;  // rows whose accumulators share the registers

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

// Output blocks [begin, end): groups of up to kGroup blocks, each read by every row tile in turn.
void run_blocks(const Problem& p, int64_t begin, int64_t end) {
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

// ---- AMX tiles (where the CPU has them): the same packed layout is already AMX's B-tile layout (16 input
// pairs x 16 outputs x 2 = one 1 KB tile per 32 inputs of a block). Tiles: 0, 1 the inputs (rows 0-15,
// 16-31), 2, 3 two output blocks' weights, 4-7 the accumulators (row tile x output block).

bool amx_usable() {
  unsigned a, b, c, d;
  if (!__get_cpuid_count(7, 0, &a, &b, &c, &d)) return false;
  if (!((d >> 22) & 1) || !((d >> 24) & 1)) return false;  // AMX-BF16, AMX-TILE
  constexpr long kReqPerm = 0x1023, kTileData = 18;  // ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA
  return syscall(SYS_arch_prctl, kReqPerm, kTileData) == 0;
}

// 0: AVX-512, 1: AMX where the CPU has it. MTPLM_FEWROW_ISA=avx512 (or use_isa("avx512")) keeps to AVX-512:
// what a CPU without AMX runs.
std::atomic<int> chosen_isa{-1};

int isa() {
  int chosen = chosen_isa.load(std::memory_order_relaxed);
  if (chosen < 0) {
    const char* asked = std::getenv("MTPLM_FEWROW_ISA");
    chosen = asked != nullptr && std::string(asked) == "avx512" ? 0 : amx_usable() ? 1 : 0;
    chosen_isa.store(chosen);
  }
  return chosen;
}

std::string isa_name() { return isa() == 1 ? "amx" : "avx512"; }

// "avx512", "amx" (AVX-512 where the CPU lacks it) or "auto" (the default choice); returns the one in use.
std::string use_isa(c10::string_view name) {
  const std::string asked(name);
  TORCH_CHECK(asked == "avx512" || asked == "amx" || asked == "auto", "fewrow: isa avx512, amx or auto");
  chosen_isa.store(asked == "avx512" ? 0 : asked == "amx" ? (amx_usable() ? 1 : 0) : -1);
  return isa_name();
}

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

// Any number of rows: whole 32-row chunks, then the rest (a second tile config, the weights read again).
__attribute__((target("amx-tile,amx-bf16")))
void amx_blocks(const Problem& p, int64_t begin, int64_t end) {
  const int64_t whole = p.n / 32 * 32;
  if (whole > 0) amx_rows(p, 0, whole, 32, begin, end);
  if (p.n > whole) amx_rows(p, whole, p.n - whole, static_cast<int>(p.n - whole), begin, end);
  _tile_release();
}

at::Tensor fewrow_linear(const at::Tensor& inputs, const at::Tensor& packed,
                         const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(inputs.dim() == 2 && packed.dim() == 3, "fewrow linear: inputs [N, K], packed [M, 1, Kp]");
  TORCH_CHECK(inputs.scalar_type() == at::kBFloat16 && packed.scalar_type() == at::kBFloat16,
              "fewrow linear: bf16 only");
  const int64_t n = inputs.size(0), k = inputs.size(1), m = packed.size(0), kp = packed.size(2);
  TORCH_CHECK(k <= kp && kp % 32 == 0 && kp - k < 32, "fewrow linear: inputs have ", k,
              " features, the packed weight ", kp);
  const at::Tensor b = bias.has_value() && bias->defined() ? bias->contiguous() : at::Tensor();
  TORCH_CHECK(!b.defined() || (b.numel() == m && b.scalar_type() == at::kBFloat16), "fewrow linear: bias");
  const bool amx = isa() == 1;
  at::Tensor x = inputs.contiguous();
  if (k != kp) {  // zero padding to the packed width
    at::Tensor padded = at::zeros({n, kp}, inputs.options());
    padded.narrow(1, 0, k).copy_(x);
    x = padded;
  }
  at::Tensor y = at::empty({n, m}, inputs.options());
  if (n == 0 || m == 0) return y;
  const Problem p{reinterpret_cast<const uint16_t*>(x.data_ptr()),
                  reinterpret_cast<const uint16_t*>(packed.data_ptr()),
                  b.defined() ? reinterpret_cast<const uint16_t*>(b.data_ptr()) : nullptr,
                  reinterpret_cast<uint16_t*>(y.data_ptr()), n, m, kp, kp};
  const int64_t blocks = (m + kBlock - 1) / kBlock;
  at::parallel_for(0, blocks, 1, [&](int64_t begin, int64_t end) {
    amx ? amx_blocks(p, begin, end) : run_blocks(p, begin, end);
  });
  return y;
}

// W [M, K] -> the packed layout, as [M, 1, Kp] over Mp * Kp elements.
at::Tensor fewrow_pack(const at::Tensor& weight) {
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == at::kBFloat16, "fewrow pack: a bf16 [M, K] weight");
  const int64_t m = weight.size(0), k = weight.size(1);
  const int64_t mp = (m + kBlock - 1) / kBlock * kBlock, kp = (k + 31) / 32 * 32;
  at::Tensor padded = at::zeros({mp, kp}, weight.options());
  padded.narrow(0, 0, m).narrow(1, 0, k).copy_(weight);
  at::Tensor blocked = padded.view({mp / kBlock, kBlock, kp / 2, 2}).permute({0, 2, 1, 3}).contiguous();
  return blocked.view({mp * kp}).as_strided({m, 1, kp}, {kp, kp, 1});
}


}  // namespace

void mtplm::fewrow::products(const Problem& p, int64_t begin, int64_t end) {
  isa() == 1 ? amx_blocks(p, begin, end) : run_blocks(p, begin, end);
}

bool mtplm::fewrow::amx() { return isa() == 1; }

void mtplm::fewrow::configure_tiles(int rows) { amx_configure(rows); }

at::Tensor mtplm::fewrow::pack(const at::Tensor& weight) { return fewrow_pack(weight); }

void mtplm::fewrow::store_tile(const Problem& p, int tile, int64_t row, int rows, int64_t block, float* scratch) {
  amx_store(p, tile, row, rows, block, scratch);
}

TORCH_LIBRARY(mtplm_fewrow, m) {
  m.def("linear(Tensor inputs, Tensor packed, Tensor? bias) -> Tensor");
  m.def("pack(Tensor weight) -> Tensor");
  m.def("isa() -> str");  // which kernel linear runs: "amx" or "avx512"
  m.def("use_isa(str isa) -> str");
}

TORCH_LIBRARY_IMPL(mtplm_fewrow, CompositeExplicitAutograd, m) {
  m.impl("isa", isa_name);
  m.impl("use_isa", use_isa);
}

TORCH_LIBRARY_IMPL(mtplm_fewrow, CPU, m) {
  m.impl("linear", fewrow_linear);
  m.impl("pack", fewrow_pack);
}
