// Few-row products over GGUF's quantized blocks (quant.py): y[N, M] = x[N, K] @ W^T (+ bias), x bf16 or
// float32, W Q8_0, Q4_0, Q4_1, Q5_0, Q4_K, Q5_K or Q6_K as the file holds it, repacked once. This file is the
// ISA-neutral part: the op, the rows quantized to int8 and the choice of kernel. The kernels:
//   quant_avx512.cpp  AVX-512 VNNI (vpdpbusd), 16 outputs a vector     (the AVX-512 build)
//   quant_avx2.cpp    AVX2 (vpmaddubsw + vpmaddwd), 8 outputs a vector  (every build)
//
// The math (every kernel and quant.reference alike, so every path gives the same bits): a row's block of 32
// inputs becomes q_x = round-half-even(x * (127 / max|x|)) in int8 with d_x = max|x| / 127 and s_x = sum q_x.
// A block's dot with an output's codes is an exact integer: vpdpbusd multiplies unsigned weights by signed
// activations, so each kind's codes are unsigned u with a fixed offset (Q4_0: u - 8, Q5_0: u - 16, Q8_0 on
// VNNI: (q ^ 0x80) - 128), folded in as the accumulator's start, -offset * s_x. Per block, in order:
// acc = fma(float(dot), d_w * d_x, acc), then for Q4_1 (w = d_w u + m_w) acc = fma(m_w, d_x * float(s_x), acc).
// The K-quants keep those per-32 activations: Q4_K and Q5_K are Q4_1's math with the block's d_w = d * sc_j
// and m_w = -(dmin * m_j) (exact float32 products of the fp16 and the 6-bit integers); Q6_K's dot is the exact
// integer sc_0 * dot_0 + sc_1 * dot_1 over the block's two halves of 16 inputs (codes u - 32, int8 scales
// sc_h; on VNNI each half's start is -32 * its s_x), with d_w the super-block's d.
// An output's sum is over its blocks in order whatever the rows, threads and ISA: a row's results do not
// depend on the rows beside it. Threads split the records (16 outputs each), never a sum.
//
// Layout (quant.pack writes it): codes [Mp / 16][K / 32][record] uint8, one record per 16 outputs x 32 inputs,
// made of 64-byte vectors whose 32-bit lane o holds output o's 4 consecutive inputs (vpdpbusd's operand):
//   Q8_0  8 vectors, vector t byte (o, j) = q of output o, input 4t + j (signed, as in the file);   512 bytes
//   Q4_*  4 vectors, vector v byte (o, j) = the file's byte 4v + j of output o's block: its low nibble input
//         4v + j, its high nibble input 16 + 4v + j (so "vector" t = 0..7 is nibble t / 4 of v = t % 4);
//         256 bytes
//   Q5_0  the Q4 record, then 8 little-endian 64-bit masks, mask t's bit 4 o + j the fifth bit (16) of output
//         o's input 4t + j;                                                                        320 bytes
//   Q4_K  the Q4 record, then sc_j of the 16 outputs (a byte each), then m_j;                      288 bytes
//   Q5_K  the Q5_0 record of the codes (low 4 bits, fifth-bit masks), then sc_j, then m_j as Q4_K;  352 bytes
//   Q6_K  the Q4 record of the codes' low 4 bits, 2 vectors of their high 2 bits (vector u byte (o, j) bits
//         2i, 2i + 1: output o's input 4 (4u + i) + j), then the int8 scales of inputs 0-15 of the 16
//         outputs, then those of inputs 16-31;                                                      416 bytes
// scales [Mp / 16][K / 32][16 S] fp16: d_w of the 16 outputs, then (Q4_1) m_w; the K-quants' [Mp / 16][K / 256]
// [16 S]: d of the 16 outputs, then (Q4_K, Q5_K) dmin. Mp: M rounded up to 16, the padding zero. So a pass
// reads about the file's bits per weight (4.5, 5, 5.5, 8.5; Q4_K 4.625, Q5_K 5.625, Q6_K 6.5625), no more. An AVX2 vector is
// half a record's vector: outputs 0-7 or 8-15.

#include "fewrow.h"
#include "quant.h"

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <string>
#include <vector>

namespace {

using mtplm::quant::Kind;
using mtplm::quant::Problem;

#define MTPLM_AVX2 __attribute__((target("avx2,fma")))

MTPLM_AVX2 inline __m256 load8(const float* x) { return _mm256_loadu_ps(x); }
MTPLM_AVX2 inline __m256 load8(const c10::BFloat16* x) {
  const __m128i half = _mm_loadu_si128(reinterpret_cast<const __m128i*>(x));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(half), 16));
}

MTPLM_AVX2 inline int32_t sum8(__m256i v) {
  __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0x4E));
  return _mm_cvtsi128_si32(_mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0xB1)));
}

// One row's K inputs -> its int8 codes, and per block of 32 d_x, the dots' start -offset * s_x and (ds not
// null) d_x * s_x (the module comment's formula); block b's at index b * n (the Problem's block-major layout).
// (halves not null: -32 * the sums over inputs 0-15 and 16-31 of each block, at index 2 (b * n) and + 1.)
template <typename T>
MTPLM_AVX2 void quantize_row(const T* x, int64_t kb, int64_t n, int32_t offset, int8_t* qx, float* dx,
                             int32_t* start, float* ds, int32_t* halves) {
  const __m256 magnitude = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
  const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
  for (int64_t b = 0; b < kb; ++b) {
    __m256 v[4];
    for (int i = 0; i < 4; ++i) v[i] = load8(x + b * 32 + 8 * i);
    __m256 top = _mm256_max_ps(_mm256_max_ps(_mm256_and_ps(v[0], magnitude), _mm256_and_ps(v[1], magnitude)),
                               _mm256_max_ps(_mm256_and_ps(v[2], magnitude), _mm256_and_ps(v[3], magnitude)));
    __m128 four = _mm_max_ps(_mm256_castps256_ps128(top), _mm256_extractf128_ps(top, 1));
    four = _mm_max_ps(four, _mm_movehl_ps(four, four));
    const float amax = _mm_cvtss_f32(_mm_max_ss(four, _mm_movehdup_ps(four)));
    const __m256 inverse = _mm256_set1_ps(amax > 0.f ? 127.f / amax : 0.f);
    __m256i q[4];
    for (int i = 0; i < 4; ++i) q[i] = _mm256_cvtps_epi32(_mm256_mul_ps(v[i], inverse));  // to nearest even
    const __m256i first = _mm256_add_epi32(q[0], q[1]), second = _mm256_add_epi32(q[2], q[3]);
    const __m256i total = _mm256_add_epi32(first, second);
    if (halves != nullptr) {
      halves[2 * b * n] = -32 * sum8(first);
      halves[2 * b * n + 1] = -32 * sum8(second);
    }
    __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(total), _mm256_extracti128_si256(total, 1));
    s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0x4E));
    s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0xB1));
    const __m256i bytes = _mm256_packs_epi16(_mm256_packs_epi32(q[0], q[1]), _mm256_packs_epi32(q[2], q[3]));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(qx + b * n * 32), _mm256_permutevar8x32_epi32(bytes, order));
    const int32_t sum = _mm_cvtsi128_si32(s4);
    const float d = amax / 127.f;
    dx[b * n] = d;
    start[b * n] = -offset * sum;
    if (ds != nullptr) ds[b * n] = d * static_cast<float>(sum);
  }
}

Kind kind_of(const std::string& name) {
  if (name == "Q8_0") return Kind::Q8_0;
  if (name == "Q4_0") return Kind::Q4_0;
  if (name == "Q4_1") return Kind::Q4_1;
  if (name == "Q4_K") return Kind::Q4_K;
  if (name == "Q5_K") return Kind::Q5_K;
  if (name == "Q6_K") return Kind::Q6_K;
  TORCH_CHECK(name == "Q5_0", "quant_linear: block type ", name,
              " is not supported (Q8_0, Q4_0, Q4_1, Q5_0, Q4_K, Q5_K, Q6_K)");
  return Kind::Q5_0;
}

// The unsigned codes' offset in the kernel that runs (u - offset is the value d_w multiplies): Q8_0's signed
// codes are offset by 128 for vpdpbusd, and multiplied as they are by AVX2's sign trick (as are Q6_K's,
// u - 32; on VNNI its offset is per half: Problem::halves). Q4_1's, Q4_K's and Q5_K's take none (their mins).
int32_t offset(Kind kind, bool vnni) {
  return kind == Kind::Q8_0 ? (vnni ? 128 : 0) : kind == Kind::Q4_0 ? 8 : kind == Kind::Q5_0 ? 16 : 0;
}

bool vnni() {
#if defined(__AVX512BF16__)
  static const bool has = __builtin_cpu_supports("avx512vnni");
  return has && !mtplm::fewrow::avx2();
#else
  return false;
#endif
}

void groups(const Problem& p, bool vnni, int64_t begin, int64_t end) {
#if defined(__AVX512BF16__)
  if (vnni) return mtplm::quant::vnni_groups(p, begin, end);
#endif
  mtplm::quant::avx2_groups(p, begin, end);
}

// The rows quantized (quantize_row's outputs, block-major: [Kb][N] each), for the kernels to read.
struct Rows {
  int8_t* qx;       // [Kb][N][32]
  float* dx;        // [Kb][N]
  int32_t* start;   // [Kb][N]
  float* ds;        // [Kb][N]
  int32_t* halves;  // [Kb][N][2]
};

// Room for `blocks` = Kb x N rows' blocks in a buffer of the calling thread that only grows: a decode pass
// calls the op ~120 times on a few rows, and five tensors a call were most of the pass's allocations.
Rows scratch(int64_t blocks) {
  thread_local std::vector<int32_t> buffer;  // 32-bit words: 8 per block of codes, 1 + 1 + 1 + 2 for the rest
  const size_t words = static_cast<size_t>(blocks) * 13;
  if (buffer.size() < words) buffer.resize(words);
  int32_t* at = buffer.data();
  return Rows{reinterpret_cast<int8_t*>(at), reinterpret_cast<float*>(at + 8 * blocks), at + 9 * blocks,
              reinterpret_cast<float*>(at + 10 * blocks), at + 11 * blocks};
}

// inputs [N, K] bf16 or float32, codes uint8 [Mp / 16, K / 32, record], scales fp16 [Mp / 16, K / 32, 16 S]
// (the K-quants: [Mp / 16, K / 256, 16 S]), bias float32 [M] or none -> [N, M] in the inputs' dtype.
at::Tensor quant_linear(const at::Tensor& inputs, const at::Tensor& codes, const at::Tensor& scales,
                        const c10::optional<at::Tensor>& bias, c10::string_view kind_name, int64_t out_features) {
  const Kind kind = kind_of(std::string(kind_name));
  TORCH_CHECK(inputs.dim() == 2 && codes.dim() == 3 && scales.dim() == 3,
              "quant_linear: inputs [N, K], codes [Mp / 16, K / 32, record], scales [Mp / 16, K / 32, 16 S]");
  const bool bf16 = inputs.scalar_type() == at::kBFloat16;
  TORCH_CHECK(bf16 || inputs.scalar_type() == at::kFloat, "quant_linear: bf16 or float32 inputs");
  const int64_t n = inputs.size(0), k = inputs.size(1), groups_m = codes.size(0), kb = codes.size(1);
  TORCH_CHECK(codes.scalar_type() == at::kByte && codes.is_contiguous() &&
                  codes.size(2) == mtplm::quant::record_bytes(kind),
              "quant_linear: codes of ", kind_name, " are contiguous uint8 records of ",
              mtplm::quant::record_bytes(kind), " bytes");
  const int64_t per = mtplm::quant::scale_blocks(kind);
  TORCH_CHECK(kb % per == 0, "quant_linear: ", kind_name, " needs in features a multiple of ", 32 * per);
  TORCH_CHECK(scales.scalar_type() == at::kHalf && scales.is_contiguous() && scales.size(0) == groups_m &&
                  scales.size(1) == kb / per && scales.size(2) == mtplm::quant::record_scales(kind),
              "quant_linear: scales [Mp / 16, K / ", 32 * per, ", ", mtplm::quant::record_scales(kind), "] fp16");
  TORCH_CHECK(k == kb * 32, "quant_linear: inputs have ", k, " features, the weight ", kb * 32);
  TORCH_CHECK(out_features > (groups_m - 1) * 16 && out_features <= groups_m * 16,
              "quant_linear: ", out_features, " out features in ", groups_m, " records");
  const at::Tensor b = bias.has_value() && bias->defined() ? bias->contiguous() : at::Tensor();
  TORCH_CHECK(!b.defined() || (b.numel() == out_features && b.scalar_type() == at::kFloat),
              "quant_linear: a float32 bias [M]");
  const at::Tensor x = inputs.contiguous();
  at::Tensor y = at::empty({n, out_features}, x.options());
  if (n == 0 || out_features == 0) return y;
  const bool min = mtplm::quant::has_min(kind), use_vnni = vnni(), split = kind == Kind::Q6_K && use_vnni;
  const Rows rows = scratch(kb * n);
  const int32_t shift = offset(kind, use_vnni);
  at::parallel_for(0, n, std::max<int64_t>(1, 16384 / k), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      float* f = min ? rows.ds + r : nullptr;
      int32_t* h = split ? rows.halves + 2 * r : nullptr;
      bf16 ? quantize_row(x.data_ptr<c10::BFloat16>() + r * k, kb, n, shift, rows.qx + r * 32, rows.dx + r,
                          rows.start + r, f, h)
           : quantize_row(x.data_ptr<float>() + r * k, kb, n, shift, rows.qx + r * 32, rows.dx + r, rows.start + r,
                          f, h);
    }
  });
  const Problem p{kind, codes.data_ptr<uint8_t>(), reinterpret_cast<const uint16_t*>(scales.data_ptr()),
                  rows.qx, rows.dx, rows.start, min ? rows.ds : nullptr, split ? rows.halves : nullptr,
                  b.defined() ? b.data_ptr<float>() : nullptr, bf16 ? nullptr : y.data_ptr<float>(),
                  bf16 ? reinterpret_cast<uint16_t*>(y.data_ptr()) : nullptr, n, out_features, kb};
  at::parallel_for(0, (out_features + 15) / 16, 1, [&](int64_t begin, int64_t end) { groups(p, use_vnni, begin, end); });
  return y;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(mtplm_fewrow, m) {
  m.def("quant_linear(Tensor inputs, Tensor codes, Tensor scales, Tensor? bias, str kind, int out_features) -> Tensor");
}

TORCH_LIBRARY_IMPL(mtplm_fewrow, CPU, m) { m.impl("quant_linear", quant_linear); }
