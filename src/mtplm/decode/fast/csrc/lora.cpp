// Gated adapters fused into their projection (forward._project_widened), one call:
//   y = x W^T + bf16(gate * x A_p^T) B_p^T (+ bias)   for the outputs of each fused part p (q, k, v; gate, up)
// for any number of rows, bf16 in and out, float32 sums; and (lora_delta) the gated low-rank delta alone, for
// a projection the adapters cannot widen (a GGUF's quantized blocks: forward.project adds it to the product).
//
// The weight is pack([W | 0 | B_c]) ([M, 1, Kp + rp]: Kp = K and rp = r rounded up to 32, fewrow.widened_weight),
// where B_c [M, r] stacks the parts' B by output rows: each output row carries its own part's r adapter columns
// only. A fused projection's [W | block_diag(B_p)] would carry the other parts' zeros too: for q, k, v at rank
// 32 that is two zero blocks of 32 inputs in every 21, read from memory for nothing. The products read x in
// place (a zero-padded copy where K is not a multiple of 32) and part p's adapter columns from its own
// columns of one small buffer, bf16(gate * x A^T) laid out [N, parts x rp] (fewrow.h's Problem::tail), so
// the sums are those of the widened product over [W | block_diag(B_p)] bitwise (the skipped columns only
// ever added zeros), and a row's sums do not depend on the rows beside it. Rows whose gate is 0 read zeros
// there and get W x exactly.
//
// x A^T (R = parts x r columns, 16 a block) runs inside the same parallel region as the product: each thread
// claims low-rank blocks until none are left, waits until every claimed block is written (claimed blocks
// are being computed by running threads, so the wait ends whatever the number of threads), then runs its
// share of the product's output blocks: 0.985x the pass of x A^T on the calling thread alone while the other
// waits, paired (a region of its own measured within noise: its barrier costs what it saves;
// docs/backends-kernels.md).

#include "fewrow.h"

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/constant_pad_nd.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <immintrin.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <vector>

namespace {

using mtplm::fewrow::kBlock;
using mtplm::fewrow::Problem;

inline int64_t round_up(int64_t value, int64_t to) { return (value + to - 1) / to * to; }

// One call's shapes and buffers. Output blocks [ends[p - 1], ends[p]) belong to part p.
struct Call {
  int64_t n, k, kp, m, rank, rp, total;  // kp: K rounded up to 32; rank: r a part; rp: r rounded up to 32
  std::vector<int64_t> ends;
  at::Tensor x;                // [n, kp]: the inputs, zero-padded where K is not a multiple of 32
  const uint16_t* a;           // pack(A): [R rounded up to 16] x kp, the W layout
  const float* gate;           // [n]
  std::vector<uint16_t> tail;  // [n, parts x rp]: bf16(gate * x A_p^T) at part p's columns p rp .., zeros
  std::vector<float> low;      // [n, Rs]: float32 x A^T (Rs: R rounded up to 16)
  int64_t parts() const { return static_cast<int64_t>(ends.size()); }
  int64_t low_stride() const { return round_up(total, kBlock); }
  const uint16_t* inputs() const { return reinterpret_cast<const uint16_t*>(x.data_ptr()); }
};

// Block j of x A^T (A's outputs 16j .. 16j + 15), scaled by each row's gate and rounded to bf16 (to nearest
// even, as the graph's own path rounds) into its part's tail columns; rows whose gate is 0 keep their zeros.
void low_block(Call& call, int64_t j) {
  const int64_t stride = call.low_stride(), width = call.parts() * call.rp;
  const Problem p{call.inputs(), call.a, nullptr, nullptr, call.n, stride, call.kp, call.kp, call.low.data()};
  mtplm::fewrow::products(p, j, j + 1);  // float32 sums into call.low
  const int64_t first = j * kBlock, last = std::min(call.total, first + kBlock);
  [[maybe_unused]] const bool whole = call.rank % kBlock == 0;  // the block lies in one part: a vector a row
  for (int64_t row = 0; row < call.n; ++row) {
    const float gate = call.gate[row];
    if (gate == 0.f) continue;
    const float* from = call.low.data() + row * stride;
    uint16_t* to = call.tail.data() + row * width;
#if defined(__AVX512BF16__)
    if (whole && !mtplm::fewrow::avx2()) {  // 16 at once; the loop below rounds the same way
      const __m512 scaled = _mm512_mul_ps(_mm512_loadu_ps(from + first), _mm512_set1_ps(gate));
      const int64_t part = first / call.rank;
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(to + part * call.rp + first - part * call.rank),
                          (__m256i)_mm512_cvtneps_pbh(scaled));
      continue;
    }
#endif
    for (int64_t c = first; c < last; ++c) {
      const c10::BFloat16 value(gate * from[c]);
      std::memcpy(to + (c / call.rank) * call.rp + c % call.rank, &value, 2);
    }
  }
}

// Output blocks [begin, end) of y, part by part: x (none for lora_delta's weight of B_c alone), then the
// part's tail columns.
void products(const Call& call, const uint16_t* w, int64_t kw, const uint16_t* bias, uint16_t* y,
              int64_t begin, int64_t end) {
  int64_t first = 0;
  for (int64_t part = 0; part < call.parts(); first = call.ends[part++]) {
    const int64_t lo = std::max(begin, first), hi = std::min(end, call.ends[part]);
    if (lo >= hi) continue;
    Problem p{call.inputs(), w + first * kw * kBlock, bias, y, call.n, call.m, kw, call.kp};
    p.first = first;
    p.tail = call.tail.data() + part * call.rp, p.ktail = kw - call.rp, p.ts = call.parts() * call.rp;
    mtplm::fewrow::products(p, lo, hi);
  }
}

// The parts' output blocks: `parts` lists each part's out features (every one but the last a multiple of 16);
// none: one part of all M.
std::vector<int64_t> part_ends(c10::IntArrayRef parts, int64_t m) {
  std::vector<int64_t> ends;
  int64_t rows = 0;
  for (size_t i = 0; i < parts.size(); ++i) {
    rows += parts[i];
    TORCH_CHECK(i + 1 == parts.size() || parts[i] % kBlock == 0,
                "fewrow lora_linear: every part but the last needs out features a multiple of 16");
    ends.push_back(round_up(rows, kBlock) / kBlock);
  }
  TORCH_CHECK(parts.empty() || rows == m, "fewrow lora_linear: parts sum to ", rows, ", the weight has ", m);
  if (ends.empty()) ends.push_back(round_up(m, kBlock) / kBlock);
  return ends;
}

void check(const at::Tensor& inputs, const at::Tensor& packed, const at::Tensor& a, const at::Tensor& gate,
           const at::Tensor& bias) {
  TORCH_CHECK(inputs.dim() == 2 && packed.dim() == 3 && a.dim() == 3 && gate.dim() == 1,
              "fewrow lora_linear: inputs [N, K], packed [M, 1, Kw], down_packed [R, 1, Kp], gate [N]");
  TORCH_CHECK(inputs.scalar_type() == at::kBFloat16 && packed.scalar_type() == at::kBFloat16 &&
                  a.scalar_type() == at::kBFloat16 && gate.scalar_type() == at::kFloat,
              "fewrow lora_linear: bf16 inputs, weights and down_packed, float32 gate");
  TORCH_CHECK(a.size(2) == round_up(inputs.size(1), 32) && gate.size(0) == inputs.size(0),
              "fewrow lora_linear: down_packed is not pack(A) of an A [R, ", inputs.size(1), "], or gate not [",
              inputs.size(0), "]");
  TORCH_CHECK(!bias.defined() || (bias.numel() == packed.size(0) && bias.scalar_type() == at::kBFloat16),
              "fewrow lora_linear: bias");
}

// The call's shapes and buffers: x (the inputs, zero-padded to kp), tail and low zeroed.
Call prepare(const at::Tensor& inputs, const at::Tensor& packed, const at::Tensor& a, const float* gate,
             c10::IntArrayRef parts, bool delta) {
  const int64_t n = inputs.size(0), k = inputs.size(1), kp = round_up(k, 32), m = packed.size(0);
  std::vector<int64_t> ends = part_ends(parts, m);
  const int64_t count = static_cast<int64_t>(ends.size()), total = a.size(0), rank = total / count;
  TORCH_CHECK(rank * count == total, "fewrow lora_linear: ", total, " adapter rows over ", count, " parts");
  const int64_t rp = round_up(rank, 32);
  TORCH_CHECK(packed.size(2) == (delta ? 0 : kp) + rp, "fewrow lora: ", delta ? 0 : k, " + ", rank,
              " features, the packed weight ", packed.size(2), delta ? " (pack(B_c))" : " (widened_weight's layout)");
  at::Tensor x = inputs.contiguous();
  if (k != kp) x = at::constant_pad_nd(x, {0, kp - k});
  return Call{n, k, kp, m, rank, rp, total, std::move(ends), x, reinterpret_cast<const uint16_t*>(a.data_ptr()),
              gate, std::vector<uint16_t>(n * count * rp, 0), std::vector<float>(n * round_up(total, kBlock), 0.f)};
}

// The product over packed's columns, x's (none where `delta`) then the gated low-rank tail's; see the ops.
at::Tensor gated(const at::Tensor& inputs, const at::Tensor& packed, const at::Tensor& a, const at::Tensor& gate,
                 const at::Tensor& b, c10::IntArrayRef parts, bool delta) {
  check(inputs, packed, a, gate, b);
  const at::Tensor g = gate.contiguous();
  Call call = prepare(inputs, packed, a, g.data_ptr<float>(), parts, delta);
  bool open = false;
  for (int64_t row = 0; row < call.n; ++row) open = open || call.gate[row] != 0.f;
  const int64_t low_blocks = open ? call.low_stride() / kBlock : 0;  // closed: the tail stays zero
  at::Tensor y = at::empty({call.n, call.m}, inputs.options());
  if (call.n == 0 || call.m == 0) return y;
  if (delta && !open) return y.zero_();
  const auto* w = reinterpret_cast<const uint16_t*>(packed.data_ptr());
  const auto* bias_bits = b.defined() ? reinterpret_cast<const uint16_t*>(b.data_ptr()) : nullptr;
  auto* out = reinterpret_cast<uint16_t*>(y.data_ptr());
  std::atomic<int64_t> next{0}, done{0};
  const int64_t blocks = call.ends.back();
  at::parallel_for(0, blocks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t j = next.fetch_add(1); j < low_blocks; j = next.fetch_add(1)) {
      low_block(call, j);
      done.fetch_add(1, std::memory_order_release);
    }
    while (done.load(std::memory_order_acquire) < low_blocks) _mm_pause();
    mtplm::fewrow::before_tile_loads();  // the tail columns other threads just wrote
    products(call, w, packed.size(2), bias_bits, out, begin, end);
  });
  return y;
}

// inputs [N, K], packed = pack(widened_weight(W, [B_p])), down_packed = pack(A) of the adapters' A [R, K]
// (R = parts x r), gate [N] float32, parts: the out features of each part (none: one part).
at::Tensor lora_linear(const at::Tensor& inputs, const at::Tensor& packed, const at::Tensor& down_packed,
                       const at::Tensor& gate, const c10::optional<at::Tensor>& bias, c10::IntArrayRef parts) {
  const at::Tensor b = bias.has_value() && bias->defined() ? bias->contiguous() : at::Tensor();
  return gated(inputs, packed, down_packed, gate, b, parts, false);
}

// The low-rank delta alone, bf16(bf16(gate * x A_p^T) B_p^T), beside a product the adapters cannot join (a
// GGUF's quantized blocks): packed = pack(B_c) [M, 1, rp], B_c the parts' B stacked by rows (widened_weight
// of a W with no columns), so an output reads its own part's r columns only; the sums are lora_linear's
// over a W of zeros, bitwise. No <mtp> row (every gate 0): zeros.
at::Tensor lora_delta(const at::Tensor& inputs, const at::Tensor& packed, const at::Tensor& down_packed,
                      const at::Tensor& gate, c10::IntArrayRef parts) {
  return gated(inputs, packed, down_packed, gate, at::Tensor(), parts, true);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(mtplm_fewrow, m) {
  m.def(
      "lora_linear(Tensor inputs, Tensor packed, Tensor down_packed, Tensor gate, Tensor? bias, int[] parts=[]) "
      "-> Tensor");
  m.def("lora_delta(Tensor inputs, Tensor packed, Tensor down_packed, Tensor gate, int[] parts=[]) -> Tensor");
}

TORCH_LIBRARY_IMPL(mtplm_fewrow, CPU, m) {
  m.impl("lora_linear", lora_linear);
  m.impl("lora_delta", lora_delta);
}
