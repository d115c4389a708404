// Group-wise int4 weights through the few-row kernel (mtplm/decode/fast/kernels.py's int4_linear): llama.cpp's
// Q4_1 scheme, 32 inputs of an output sharing a bf16 scale and zero, w = (q - 8) * scale + zero. The weights
// are dequantized to bf16 in cache and multiplied by fewrow.cpp's products: up to 32 rows on AMX, each group's
// two B tiles right before the tile products that read them; otherwise two output blocks at a time into
// pack()'s layout, then fewrow's own products over them. Memory reads 5/16 of bf16's and the cost stays about
// as flat in rows as the bf16 kernel's; the dequantizing (about 10 vector ops per 32 weights) is what a pass
// pays instead (docs/backends-kernels.md). The weights it multiplies are bitwise kernels.dequantize_int4's.
//
// Each code byte holds lane l of two float32 vectors (outputs 0-7's pairs and outputs 8-15's), so one
// conversion of the two to bf16 lands the group's pair row in the B tile's order with no shuffle.
//
// Layout (kernels.quantize_int4 writes it): codes [Mp / 16][K / 32][16 pairs][16 lanes] bytes, byte (i, l) =
// q[l / 2][2i + l % 2] | q[8 + l / 2][2i + l % 2] << 4 over the group's 32 inputs; scales [Mp / 16][K / 32][2][16]
// bf16 (each output's scale, then its zero). Presented as [M, 1, K / 2] uint8 and [M, 1, K / 16] bf16 over that
// storage.

#include "fewrow.h"

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <vector>

namespace {

using mtplm::fewrow::kBlock;
using mtplm::fewrow::before_tile_loads;
using mtplm::fewrow::Problem;

constexpr int64_t kGroup = 32;        // inputs per scale and zero: one AMX k-step
constexpr int64_t kAhead = 8;         // groups prefetched ahead (without: stalls on the codes)
constexpr int64_t kBlocksAtOnce = 2;  // output blocks dequantized together off the AMX path

inline __m512 bf16_to_float(const uint16_t* from) {
  const __m256i half = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(from));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(half), 16));
}

struct Lanes {  // output (lane / 2) and (8 + lane / 2): a group's scales spread over the lanes of its codes
  __m512i first = _mm512_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 7);
  __m512i last = _mm512_add_epi32(first, _mm512_set1_epi32(8));
};

// One group (32 inputs) of one output block: 1 KB of bf16 (an AMX B tile) from 256 bytes of codes.
inline void dequantize_group(const uint8_t* codes, const uint16_t* scales, const Lanes& lanes, uint16_t* out) {
  const __m512i nibble = _mm512_set1_epi32(15);
  const __m512 eight = _mm512_set1_ps(8.f);
  const __m512 scale = bf16_to_float(scales), zero = bf16_to_float(scales + 16);
  const __m512 scale_a = _mm512_permutexvar_ps(lanes.first, scale), zero_a = _mm512_permutexvar_ps(lanes.first, zero);
  const __m512 scale_b = _mm512_permutexvar_ps(lanes.last, scale), zero_b = _mm512_permutexvar_ps(lanes.last, zero);
  for (int i = 0; i < 16; ++i) {  // pair i of the group's inputs
    const __m512i q = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(codes + i * 16)));
    const __m512 a = _mm512_sub_ps(_mm512_cvtepi32_ps(_mm512_and_si512(q, nibble)), eight);
    const __m512 b = _mm512_sub_ps(_mm512_cvtepi32_ps(_mm512_srli_epi32(q, 4)), eight);
    const __m512bh both = _mm512_cvtne2ps_pbh(_mm512_fmadd_ps(b, scale_b, zero_b), _mm512_fmadd_ps(a, scale_a, zero_a));
    _mm512_storeu_si512(out + i * 2 * kBlock, (__m512i)both);
  }
}

inline void prefetch_group(const uint8_t* codes, const uint16_t* scales) {
  for (int line = 0; line < 4; ++line) _mm_prefetch(reinterpret_cast<const char*>(codes) + line * 64, _MM_HINT_T0);
  _mm_prefetch(reinterpret_cast<const char*>(scales), _MM_HINT_T0);
}

// One output block's K inputs as bf16 in pack()'s layout ([K / 2][16][2]).
void dequantize_block(const uint8_t* codes, const uint16_t* scales, int64_t groups, uint16_t* out) {
  const Lanes lanes;
  for (int64_t g = 0; g < groups; ++g) {
    prefetch_group(codes + (g + kAhead) * 256, scales + (g + kAhead) * 32);
    dequantize_group(codes + g * 256, scales + g * 32, lanes, out + g * 16 * 2 * kBlock);
  }
}

struct Quantized {
  const uint8_t* codes;
  const uint16_t* scales;
  int64_t groups;
};

// AMX, rows [row, row + rows) (<= 32, as configured) x output blocks block and block + 1 (Two): each group's
// weights dequantized into two B tiles in L1 right before the tile products that read them.
template <bool Wide, bool Two>
__attribute__((target("amx-tile,amx-bf16,avx512f,avx512bw,avx512vl,avx512bf16")))
void amx_int4_pair(const Problem& p, const Quantized& w, int64_t row, int rows, int64_t block, float* scratch) {
  _tile_zero(4);
  if (Two) _tile_zero(5);
  if (Wide) _tile_zero(6);
  if (Wide && Two) _tile_zero(7);
  const Lanes lanes;
  alignas(64) uint16_t tiles[2][16 * 2 * kBlock];
  const int64_t stride = p.xs * 2;
  const uint8_t* codes[2] = {w.codes + block * w.groups * 256, w.codes + (block + 1) * w.groups * 256};
  const uint16_t* scales[2] = {w.scales + block * w.groups * 32, w.scales + (block + 1) * w.groups * 32};
  const uint16_t* x = p.x + row * p.xs;
  for (int64_t g = 0; g < w.groups; ++g) {
    for (int b = 0; b < (Two ? 2 : 1); ++b) {
      prefetch_group(codes[b] + (g + kAhead) * 256, scales[b] + (g + kAhead) * 32);
      dequantize_group(codes[b] + g * 256, scales[b] + g * 32, lanes, tiles[b]);
    }
    before_tile_loads();
    _tile_loadd(0, x + g * 32, stride);
    _tile_loadd(2, tiles[0], 64);
    if (Wide) _tile_loadd(1, x + 16 * p.xs + g * 32, stride);
    _tile_dpbf16ps(4, 0, 2);
    if (Wide) _tile_dpbf16ps(6, 1, 2);
    if (Two) {
      _tile_loadd(3, tiles[1], 64);
      _tile_dpbf16ps(5, 0, 3);
      if (Wide) _tile_dpbf16ps(7, 1, 3);
    }
  }
  const int top = std::min(rows, 16), bottom = rows - top;
  mtplm::fewrow::store_tile(p, 4, row, top, block, scratch);
  if (Two) mtplm::fewrow::store_tile(p, 5, row, top, block + 1, scratch);
  if (Wide) mtplm::fewrow::store_tile(p, 6, row + 16, bottom, block, scratch);
  if (Wide && Two) mtplm::fewrow::store_tile(p, 7, row + 16, bottom, block + 1, scratch);
}

// Output blocks [begin, end) of up to 32 rows through AMX, two blocks at a time.
__attribute__((target("amx-tile,amx-bf16")))
void amx_int4_blocks(const Problem& p, const Quantized& w, int64_t begin, int64_t end) {
  mtplm::fewrow::configure_tiles(static_cast<int>(p.n));
  alignas(64) float scratch[16 * kBlock];
  const int rows = static_cast<int>(p.n);
  for (int64_t block = begin; block < end; block += 2) {
    const bool two = block + 1 < end;
    if (rows > 16) two ? amx_int4_pair<true, true>(p, w, 0, rows, block, scratch)
                       : amx_int4_pair<true, false>(p, w, 0, rows, block, scratch);
    else two ? amx_int4_pair<false, true>(p, w, 0, rows, block, scratch)
             : amx_int4_pair<false, false>(p, w, 0, rows, block, scratch);
  }
  _tile_release();
}

// Any rows, either ISA: a few output blocks dequantized into `weights` (pack()'s layout), then fewrow's own
// products over them.
void staged_blocks(const Problem& p, const Quantized& w, int64_t begin, int64_t end, std::vector<uint16_t>& weights) {
  const int64_t k = p.kp;
  weights.resize(std::max<size_t>(weights.size(), kBlocksAtOnce * k * kBlock));
  for (int64_t block = begin; block < end; block += kBlocksAtOnce) {
    const int64_t last = std::min(end, block + kBlocksAtOnce);
    for (int64_t j = block; j < last; ++j)
      dequantize_block(w.codes + j * w.groups * 256, w.scales + j * w.groups * 32, w.groups,
                       weights.data() + (j - block) * k * kBlock);
    Problem part = p;
    part.w = weights.data(), part.first = block;
    mtplm::fewrow::products(part, block, last);
  }
}

// inputs [N, K] bf16 (K a multiple of 32), codes [M, 1, K / 2] uint8, scales [M, 1, K / 16] bf16 (the layout
// above), bias [M] bf16 or none -> [N, M] bf16.
at::Tensor int4_linear(const at::Tensor& inputs, const at::Tensor& codes, const at::Tensor& scales,
                       const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(inputs.dim() == 2 && codes.dim() == 3 && scales.dim() == 3,
              "fewrow int4_linear: inputs [N, K], codes [M, 1, K / 2], scales [M, 1, K / 16]");
  const int64_t n = inputs.size(0), k = inputs.size(1), m = codes.size(0);
  TORCH_CHECK(inputs.scalar_type() == at::kBFloat16 && codes.scalar_type() == at::kByte &&
                  scales.scalar_type() == at::kBFloat16,
              "fewrow int4_linear: bf16 inputs and scales, uint8 codes");
  TORCH_CHECK(k % kGroup == 0 && codes.size(2) * 2 == k && scales.size(2) * 16 == k && scales.size(0) == m,
              "fewrow int4_linear: inputs have ", k, " features, the codes ", codes.size(2) * 2);
  const at::Tensor b = bias.has_value() && bias->defined() ? bias->contiguous() : at::Tensor();
  TORCH_CHECK(!b.defined() || (b.numel() == m && b.scalar_type() == at::kBFloat16), "fewrow int4_linear: bias");
  const at::Tensor x = inputs.contiguous();
  at::Tensor y = at::empty({n, m}, inputs.options());
  if (n == 0 || m == 0) return y;
  const Problem p{reinterpret_cast<const uint16_t*>(x.data_ptr()), nullptr,
                  b.defined() ? reinterpret_cast<const uint16_t*>(b.data_ptr()) : nullptr,
                  reinterpret_cast<uint16_t*>(y.data_ptr()), n, m, k, k};
  const Quantized w{reinterpret_cast<const uint8_t*>(codes.data_ptr()),
                    reinterpret_cast<const uint16_t*>(scales.data_ptr()), k / kGroup};
  const bool fused = mtplm::fewrow::amx() && n <= 32;
  at::parallel_for(0, (m + kBlock - 1) / kBlock, 1, [&](int64_t begin, int64_t end) {
    thread_local std::vector<uint16_t> weights;
    fused ? amx_int4_blocks(p, w, begin, end) : staged_blocks(p, w, begin, end, weights);
  });
  return y;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(mtplm_fewrow, m) {
  m.def("int4_linear(Tensor inputs, Tensor codes, Tensor scales, Tensor? bias) -> Tensor");
}

TORCH_LIBRARY_IMPL(mtplm_fewrow, CPU, m) { m.impl("int4_linear", int4_linear); }
