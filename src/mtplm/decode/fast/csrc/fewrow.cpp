// Few-row bf16 products at the memory bound: y[N, M] = x[N, K] @ W^T (+ bias), bf16 in and out, fp32
// accumulation, for the N = 1..32 rows of a decode pass (mtplm/decode/fast/fewrow.py builds and loads this).
//
// W is packed once as [Mp / 16][Kp / 2][16][2] (Mp, Kp: M rounded up to 16, K to 32, zero padded): for
// each block of 16 outputs, each pair of inputs is 64 contiguous bytes, so one vdpbf16ps per row (the row's
// input pair broadcast) adds 16 outputs' partial sums with no horizontal reduction. A group of up to 4
// output blocks is streamed from memory once and held in L1/L2 while every tile of up to 6 rows reads it
// (all of a tile's accumulators live in registers). at::parallel_for splits the output blocks over the
// threads. More than 32 rows (prompt passes): the weight is viewed back as [M, K] and handed to at::linear.
//
// The packed tensor is presented as [M, 1, Kp] over storage of Mp * Kp elements (an opaque weight whose
// shape names the true out features; fewrow.py's fake kernel reads it).

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/linear.h>
#include <ATen/ops/zeros.h>
#include <torch/library.h>

#include <immintrin.h>

#include <cstdint>
#include <cstring>

namespace {

constexpr int kBlock = 16;    // outputs per vdpbf16ps
constexpr int kGroup = 4;     // output blocks streamed together
constexpr int kTileRows = 6;  // rows whose accumulators share the registers
constexpr int64_t kMaxRows = 32;

struct Problem {
  const uint16_t* x;  // [N, Kp] bf16 bits
  const uint16_t* w;  // packed
  const uint16_t* bias;  // [M] bf16 bits or null
  uint16_t* y;  // [N, M]
  int64_t n, m, kp;
};

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
  const uint16_t* w = p.w + block * p.kp * kBlock;
  const uint16_t* x = p.x + row * p.kp;
  const int64_t pairs = p.kp / 2;
  for (int64_t k = 0; k < pairs; ++k) {
    __m512bh wv[B];
    for (int b = 0; b < B; ++b)
      wv[b] = (__m512bh)_mm512_loadu_si512(w + (b * pairs + k) * 2 * kBlock);
    for (int r = 0; r < R; ++r) {
      int32_t pair;
      std::memcpy(&pair, x + r * p.kp + 2 * k, sizeof(pair));
      __m512bh xv = (__m512bh)_mm512_set1_epi32(pair);
      for (int b = 0; b < B; ++b) acc[r][b] = _mm512_dpbf16_ps(acc[r][b], xv, wv[b]);
    }
  }
  for (int b = 0; b < B; ++b) {
    const int64_t col = (block + b) * kBlock;
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
  if (n > kMaxRows) return at::linear(inputs, unpacked(packed, k), b);
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
                  reinterpret_cast<uint16_t*>(y.data_ptr()), n, m, kp};
  const int64_t blocks = (m + kBlock - 1) / kBlock;
  at::parallel_for(0, blocks, 1, [&](int64_t begin, int64_t end) { run_blocks(p, begin, end); });
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

TORCH_LIBRARY(mtplm_fewrow, m) {
  m.def("linear(Tensor inputs, Tensor packed, Tensor? bias) -> Tensor");
  m.def("pack(Tensor weight) -> Tensor");
}

TORCH_LIBRARY_IMPL(mtplm_fewrow, CPU, m) {
  m.impl("linear", fewrow_linear);
  m.impl("pack", fewrow_pack);
}
