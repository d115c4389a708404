// Few-row bf16 products at the memory bound: y[N, M] = x[N, K] @ W^T (+ bias), bf16 in and out, fp32
// accumulation, for the few rows of a decode pass and the many of a prompt (fewrow.py builds and loads this).
// This file is the ISA-neutral part: the op, the packing and the choice of kernel. The kernels:
//   fewrow_avx512.cpp  AVX-512 register tiles over vdpbf16ps          (the AVX-512 build)
//   fewrow_amx.cpp     AMX tiles, where the CPU has them              (the AVX-512 build)
//   fewrow_avx2.cpp    AVX2 + FMA register tiles in float32           (every build)
// fewrow.py builds with AVX-512 flags on a CPU with avx512_bf16 and with AVX2 flags on one with AVX2 and FMA
// only; the AVX-512 build can also run the AVX2 kernels (use_isa("avx2")), bitwise as an AVX2 CPU runs them.
// Each kernel sums every output of every row in one order, fixed by the ISA alone: a row's result does not
// depend on how many rows a call multiplies.
//
// W is packed once as [Mp / 16][Kp / 2][16][2] (Mp, Kp: M rounded up to 16, K to 32, zero padded): for
// each block of 16 outputs, each pair of inputs is 64 contiguous bytes, one vdpbf16ps operand, one AMX
// B-tile row, or two AVX2 registers of 8 outputs (each 32-bit lane an output's pair: input 2i in its low
// half, 2i + 1 in its high half). The packed tensor is presented as [M, 1, Kp] over storage of Mp * Kp
// elements (an opaque weight whose shape names the true out features; fewrow.py's fake kernel reads it).

#include "fewrow.h"

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <torch/library.h>

#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <string>

namespace {

using mtplm::fewrow::kBlock;
using mtplm::fewrow::Problem;

#if defined(__AVX512BF16__)
constexpr bool kAvx512Build = true;
#else
constexpr bool kAvx512Build = false;
#endif

// 0: AVX-512, 1: AMX, 2: AVX2. The AVX-512 build picks AMX where the CPU has it, else AVX-512;
// MTPLM_FEWROW_ISA=avx512 or avx2 (or use_isa) keeps to one of those: what a CPU without AMX, or without
// AVX-512, runs. The AVX2 build runs AVX2.
std::atomic<int> chosen_isa{-1};

bool amx_usable() {
#if defined(__AVX512BF16__)
  return mtplm::fewrow::amx_usable();
#else
  return false;
#endif
}

int default_isa() {
  if (!kAvx512Build) return 2;
  const char* asked = std::getenv("MTPLM_FEWROW_ISA");
  const std::string name = asked != nullptr ? asked : "";
  return name == "avx2" ? 2 : name == "avx512" ? 0 : amx_usable() ? 1 : 0;
}

int isa() {
  int chosen = chosen_isa.load(std::memory_order_relaxed);
  if (chosen < 0) {
    chosen = default_isa();
    chosen_isa.store(chosen);
  }
  return chosen;
}

std::string isa_name() {
  const int chosen = isa();
  return chosen == 1 ? "amx" : chosen == 2 ? "avx2" : "avx512";
}

// "avx2", "avx512", "amx" (each falls back to the next one down that this build and CPU have) or "auto" (the
// default choice); returns the one in use.
std::string use_isa(c10::string_view name) {
  const std::string asked(name);
  TORCH_CHECK(asked == "avx2" || asked == "avx512" || asked == "amx" || asked == "auto",
              "fewrow: isa avx2, avx512, amx or auto");
  int chosen = -1;
  if (asked == "avx2" || !kAvx512Build) chosen = asked == "auto" ? -1 : 2;
  else if (asked == "avx512") chosen = 0;
  else if (asked == "amx") chosen = amx_usable() ? 1 : 0;
  chosen_isa.store(chosen);
  return isa_name();
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
  at::parallel_for(0, blocks, 1, [&](int64_t begin, int64_t end) { mtplm::fewrow::products(p, begin, end); });
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
#if defined(__AVX512BF16__)
  const int chosen = isa();
  if (chosen == 1) return amx_blocks(p, begin, end);
  if (chosen == 0) return avx512_blocks(p, begin, end);
#endif
  avx2_blocks(p, begin, end);
}

bool mtplm::fewrow::amx() { return isa() == 1; }

bool mtplm::fewrow::avx2() { return isa() == 2; }

at::Tensor mtplm::fewrow::pack(const at::Tensor& weight) { return fewrow_pack(weight); }

TORCH_LIBRARY(mtplm_fewrow, m) {
  m.def("linear(Tensor inputs, Tensor packed, Tensor? bias) -> Tensor");
  m.def("pack(Tensor weight) -> Tensor");
  m.def("isa() -> str");  // which kernel linear runs: "amx", "avx512" or "avx2"
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
