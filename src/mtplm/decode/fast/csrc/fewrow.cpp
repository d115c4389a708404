// Few-row bf16 products at the memory bound: y[N, M] = x[N, K] @ W^T (+ bias), bf16 in and out, fp32
// accumulation, for the N = 1..32 rows of a decode pass (mtplm/decode/fast/fewrow.py builds and loads this).
//
// W is packed once as [Mp / 16][Kp / 2][16][2] (Mp, Kp: M rounded up to 16, K to 32, zero padded): for
// each block of 16 outputs, each pair of inputs is 64 contiguous bytes, so one vdpbf16ps per row (the row's
// input pair broadcast) adds 16 outputs' partial sums with no horizontal reduction. A group of up to 4
// output blocks is streamed from memory once and held in L1/L2 while every tile of up to 6 rows reads it
// (all of a tile's accumulators live in registers). at::parallel_for splits the output blocks over the
// threads. More than 32 rows on the AVX-512 path (prompt passes): the weight is unpacked to [M, K] (a copy per
// call) and handed to at::linear. The AMX path (below) takes any row count in 32-row chunks.
//
// The packed tensor is presented as [M, 1, Kp] over storage of Mp * Kp elements (an opaque weight whose
// shape names the true out features; fewrow.py's fake kernel reads it).

#include "fewrow.h"

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/linear.h>
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
#include <vector>

namespace {

using mtplm::fewrow::kBlock;  // outputs per vdpbf16ps
using mtplm::fewrow::Problem;
using mtplm::fewrow::TileConfig;
constexpr int kGroup = 4;     // output blocks streamed together
constexpr int kTileRows = 6;  // rows whose accumulators share the registers
constexpr int64_t kMaxRows = 32;      // AVX-512: more rows go to at::linear
constexpr int64_t kMaxAmxRows = 1 << 20;  // AMX: any rows

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

// Rows [row, row + R) x output blocks [block, block + B): the whole K loop with R * B accumulators.
template <int R, int B>
void tile(const Problem& p, int64_t row, int64_t block) {
  __m512 acc[R][B];
  for (int r = 0; r < R; ++r)
    for (int b = 0; b < B; ++b) acc[r][b] = _mm512_setzero_ps();
  const uint16_t* w = p.w + (block - p.first) * p.kp * kBlock;
  const uint16_t* x = p.x + row * p.xs;
  const int64_t pairs = p.kp / 2;
  for (int64_t k = 0; k < pairs; ++k) {
    __m512bh wv[B];
    for (int b = 0; b < B; ++b)
      wv[b] = (__m512bh)_mm512_loadu_si512(w + (b * pairs + k) * 2 * kBlock);
    for (int r = 0; r < R; ++r) {
      int32_t pair;
      std::memcpy(&pair, x + r * p.xs + 2 * k, sizeof(pair));
      __m512bh xv = (__m512bh)_mm512_set1_epi32(pair);
      for (int b = 0; b < B; ++b) acc[r][b] = _mm512_dpbf16_ps(acc[r][b], xv, wv[b]);
    }
  }
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
  const __m512 bias = load_bias(p.bias, col, p.m);
  for (int r = 0; r < rows; ++r)
    store_row(p.y + (row + r) * p.m, col, p.m, _mm512_add_ps(_mm512_load_ps(scratch + r * kBlock), bias));
}

// Rows [row, row + rows) (rows <= 32, as the tile config says) x output blocks block (and block + 1: Two).
template <bool Wide, bool Two>
__attribute__((target("amx-tile,amx-bf16,avx512f,avx512bw,avx512vl,avx512bf16")))
void amx_pair(const Problem& p, int64_t row, int rows, int64_t block, float* scratch) {
  _tile_zero(4);
  if (Two) _tile_zero(5);
  if (Wide) _tile_zero(6);
  if (Wide && Two) _tile_zero(7);
  const int64_t stride = p.xs * 2, per_block = p.kp * kBlock;
  const uint16_t* w0 = p.w + (block - p.first) * per_block;
  const uint16_t* x = p.x + row * p.xs;
  for (int64_t k = 0; k < p.kp; k += 32) {
    _tile_loadd(0, x + k, stride);
    _tile_loadd(2, w0 + k * kBlock, 64);
    if (Wide) _tile_loadd(1, x + 16 * p.xs + k, stride);
    _tile_dpbf16ps(4, 0, 2);
    if (Wide) _tile_dpbf16ps(6, 1, 2);
    if (Two) {
      _tile_loadd(3, w0 + per_block + k * kBlock, 64);
      _tile_dpbf16ps(5, 0, 3);
      if (Wide) _tile_dpbf16ps(7, 1, 3);
    }
  }
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

at::Tensor unpacked(const at::Tensor& packed, int64_t k) {
  const int64_t m = packed.size(0), kp = packed.size(2), mp = (m + kBlock - 1) / kBlock * kBlock;
  at::Tensor blocked = packed.as_strided({mp / kBlock, kp / 2, kBlock, 2}, {kp * kBlock, 2 * kBlock, 2, 1});
  return blocked.permute({0, 2, 1, 3}).reshape({mp, kp}).narrow(0, 0, m).narrow(1, 0, k);
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
  if (n > kMaxRows && (!amx || n > kMaxAmxRows)) return at::linear(inputs, unpacked(packed, k), b);
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


// ---- gated adapters fused into the widened product (forward._project_widened): y = [x, gate * x A^T] @ [W | B]^T
// (+ bias) in one call, without [x, gate * x A^T] built by the graph. x A^T is a few-row product over A packed
// in the W layout (pack(A), held by the caller from load): AMX tiles for up to 32 rows where the CPU has them,
// else the AVX-512 register tiles above with float32 outputs; either way no horizontal sums, and a row's sums
// do not depend on the rows beside it. Rows whose gate is 0 keep zero activations (the product gives W x
// exactly); the others are rounded to bf16 (round to nearest even) as the graph's own path rounds them.

// ---- the low-rank activations through AMX tiles over A packed once at load (pack(A): [R, 1, Ka], the W
// layout): x A^T of up to 32 rows in float32, one 16-output block of A per tile product, the blocks split over
// the threads. x is read from the joined input (row stride kp), whose columns past K are zero at that point.

template <bool Wide>
__attribute__((target("amx-tile,amx-bf16")))
void amx_low_block(const uint16_t* x, int64_t kp, const uint16_t* a, int64_t ka, float* out, int64_t stride) {
  _tile_zero(4);
  if (Wide) _tile_zero(6);
  for (int64_t k = 0; k < ka; k += 32) {
    _tile_loadd(0, x + k, kp * 2);
    _tile_loadd(2, a + k * kBlock, 64);
    _tile_dpbf16ps(4, 0, 2);
    if (Wide) {
      _tile_loadd(1, x + 16 * kp + k, kp * 2);
      _tile_dpbf16ps(6, 1, 2);
    }
  }
  _tile_stored(4, out, stride * 4);
  if (Wide) _tile_stored(6, out + 16 * stride, stride * 4);
}

// A's output blocks [begin, end) of low[N, stride] (AMX, N <= 32).
__attribute__((target("amx-tile,amx-bf16")))
void amx_low_blocks(const uint16_t* x, int64_t kp, int64_t n, const uint16_t* a, int64_t ka, float* low,
                    int64_t stride, int64_t begin, int64_t end) {
  amx_configure(static_cast<int>(n));
  for (int64_t block = begin; block < end; ++block) {
    const uint16_t* w = a + block * ka * kBlock;
    if (n > 16) amx_low_block<true>(x, kp, w, ka, low + block * kBlock, stride);
    else amx_low_block<false>(x, kp, w, ka, low + block * kBlock, stride);
  }
  _tile_release();
}

// low[N, Rp] (Rp: R rounded up to 16) = x[N, :Ka] A^T (x's rows kp apart): AMX tiles for up to 32 rows, else
// the AVX-512 tiles. A small product runs on the calling thread: waking the others costs more than it saves.
constexpr int64_t kParallelLowRank = 1 << 19;  // multiply-adds

void low_rank(const uint16_t* x, int64_t kp, int64_t n, const at::Tensor& a_packed, float* low) {
  const int64_t r = a_packed.size(0), ka = a_packed.size(2), blocks = (r + kBlock - 1) / kBlock;
  const uint16_t* a = reinterpret_cast<const uint16_t*>(a_packed.data_ptr());
  const bool tiles = isa() == 1 && n <= 32;
  const Problem p{x, a, nullptr, nullptr, n, blocks * kBlock, ka, kp, low};
  const int64_t grain = n * ka * blocks * kBlock < kParallelLowRank ? blocks : 1;
  at::parallel_for(0, blocks, grain, [&](int64_t begin, int64_t end) {
    tiles ? amx_low_blocks(x, kp, n, a, ka, low, blocks * kBlock, begin, end) : run_blocks(p, begin, end);
  });
}

// The joined input's low-rank columns [K, K + R): bf16(gate * x A^T), zeros where the gate is 0 (rounded as
// the graph's own path rounds them).
void joined_low_rank(uint16_t* joined, int64_t kp, int64_t k, int64_t n, const at::Tensor& a_packed,
                     const float* gate) {
  const int64_t r = a_packed.size(0), stride = (r + kBlock - 1) / kBlock * kBlock;
  bool any = false;
  for (int64_t row = 0; row < n; ++row) any = any || gate[row] != 0.f;
  if (!any) return;  // the columns are zero already
  alignas(64) float low[32 * 96];
  std::vector<float> wide;
  float* out = low;
  if (n * stride > 32 * 96) {
    wide.resize(n * stride);
    out = wide.data();
  }
  low_rank(joined, kp, n, a_packed, out);
  for (int64_t row = 0; row < n; ++row) {
    if (gate[row] == 0.f) continue;
    const __m512 scale = _mm512_set1_ps(gate[row]);
    for (int64_t j = 0; j < r; j += kBlock)  // round to nearest even, as c10::BFloat16 rounds
      store_row(joined + row * kp + k, j, r, _mm512_mul_ps(_mm512_loadu_ps(out + row * stride + j), scale));
  }
}

// inputs [N, K], packed = pack([W | B]) ([M, 1, Kp], Kp >= K + R), down = A [R, K] bf16, gate [N] float32;
// down_packed = pack(A) where the caller holds one (else A is packed per call).
at::Tensor fewrow_lora_linear(const at::Tensor& inputs, const at::Tensor& packed, const at::Tensor& down,
                              const at::Tensor& gate, const c10::optional<at::Tensor>& bias,
                              const c10::optional<at::Tensor>& down_packed) {
  TORCH_CHECK(inputs.dim() == 2 && packed.dim() == 3 && down.dim() == 2 && gate.dim() == 1,
              "fewrow lora_linear: inputs [N, K], packed [M, 1, Kp], down [R, K], gate [N]");
  TORCH_CHECK(inputs.scalar_type() == at::kBFloat16 && packed.scalar_type() == at::kBFloat16 &&
                  down.scalar_type() == at::kBFloat16 && gate.scalar_type() == at::kFloat,
              "fewrow lora_linear: bf16 inputs, weights and down, float32 gate");
  const int64_t n = inputs.size(0), k = inputs.size(1), m = packed.size(0), kp = packed.size(2);
  const int64_t r = down.size(0), wide = k + r;
  TORCH_CHECK(down.size(1) == k && gate.size(0) == n, "fewrow lora_linear: down [R, ", k, "], gate [", n, "]");
  TORCH_CHECK(wide <= kp && kp % 32 == 0 && kp - wide < 32, "fewrow lora_linear: ", k, " + ", r,
              " features, the packed weight ", kp);
  const at::Tensor b = bias.has_value() && bias->defined() ? bias->contiguous() : at::Tensor();
  TORCH_CHECK(!b.defined() || (b.numel() == m && b.scalar_type() == at::kBFloat16), "fewrow lora_linear: bias");
  const at::Tensor x = inputs.contiguous(), g = gate.contiguous();
  at::Tensor joined = at::empty({n, kp}, inputs.options());  // [x, gate * x A^T, zero padding]
  uint16_t* dst = reinterpret_cast<uint16_t*>(joined.data_ptr());
  const uint16_t* src = reinterpret_cast<const uint16_t*>(x.data_ptr());
  const bool amx = isa() == 1;
  const bool held = down_packed.has_value() && down_packed->defined();
  TORCH_CHECK(!held || (down_packed->dim() == 3 && down_packed->size(0) == r &&
                        down_packed->size(2) == (k + 31) / 32 * 32 && down_packed->scalar_type() == at::kBFloat16),
              "fewrow lora_linear: down_packed is not pack(down)");
  for (int64_t row = 0; row < n; ++row) {  // x A^T reads zeros past K, then writes the adapter's columns
    std::memcpy(dst + row * kp, src + row * k, k * sizeof(uint16_t));
    std::memset(dst + row * kp + k, 0, (kp - k) * sizeof(uint16_t));
  }
  joined_low_rank(dst, kp, k, n, held ? *down_packed : fewrow_pack(down.contiguous()), g.data_ptr<float>());
  if (n > kMaxRows && !amx) return at::linear(joined.narrow(1, 0, wide), unpacked(packed, wide), b);
  at::Tensor y = at::empty({n, m}, inputs.options());
  if (n == 0 || m == 0) return y;
  const Problem p{dst, reinterpret_cast<const uint16_t*>(packed.data_ptr()),
                  b.defined() ? reinterpret_cast<const uint16_t*>(b.data_ptr()) : nullptr,
                  reinterpret_cast<uint16_t*>(y.data_ptr()), n, m, kp, kp};
  at::parallel_for(0, (m + kBlock - 1) / kBlock, 1, [&](int64_t begin, int64_t end) {
    amx ? amx_blocks(p, begin, end) : run_blocks(p, begin, end);
  });
  return y;
}

}  // namespace

void mtplm::fewrow::products(const Problem& p, int64_t begin, int64_t end) {
  isa() == 1 ? amx_blocks(p, begin, end) : run_blocks(p, begin, end);
}

bool mtplm::fewrow::amx() { return isa() == 1; }

void mtplm::fewrow::configure_tiles(int rows) { amx_configure(rows); }

void mtplm::fewrow::store_tile(const Problem& p, int tile, int64_t row, int rows, int64_t block, float* scratch) {
  amx_store(p, tile, row, rows, block, scratch);
}

TORCH_LIBRARY(mtplm_fewrow, m) {
  m.def("linear(Tensor inputs, Tensor packed, Tensor? bias) -> Tensor");
  m.def("pack(Tensor weight) -> Tensor");
  m.def(
      "lora_linear(Tensor inputs, Tensor packed, Tensor down, Tensor gate, Tensor? bias, Tensor? down_packed=None) "
      "-> Tensor");
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
  m.impl("lora_linear", fewrow_lora_linear);
}
