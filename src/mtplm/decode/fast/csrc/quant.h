// What quant.cpp (the op over GGUF's blocks: the rows quantized to int8, the ISA choice) and its kernels per
// ISA (quant_avx512.cpp: AVX-512 VNNI; quant_avx2.cpp: AVX2) share: the problem and the record layout.
#pragma once

#include <cstdint>

namespace mtplm::quant {

enum class Kind { Q8_0, Q4_0, Q4_1, Q5_0, Q4_K, Q5_K, Q6_K };

constexpr int kOutputs = 16;  // outputs per record: one 512-bit vector's 32-bit lanes
constexpr int kInputs = 32;   // inputs per GGUF block

// Bytes of codes per record (16 outputs x 32 inputs; the K-quants' with their sub-block scales), fp16 scales
// per record of scales (d_w, then m_w for Q4_1; the K-quants' d, then dmin for Q4_K, Q5_K) and the blocks of 32
// inputs such a record of scales covers (the K-quants: a super-block of 256 inputs).
constexpr int64_t record_bytes(Kind kind) {
  return kind == Kind::Q8_0   ? 512
         : kind == Kind::Q5_0 ? 320
         : kind == Kind::Q4_K ? 288
         : kind == Kind::Q5_K ? 352
         : kind == Kind::Q6_K ? 416
                              : 256;
}
// Whether a record ends with its 16 outputs' 6-bit sub-block scales sc_j, then mins m_j (a byte each).
constexpr bool sub_scales(Kind kind) { return kind == Kind::Q4_K || kind == Kind::Q5_K; }
// Whether a record's Q4 nibbles are followed by 8 64-bit masks of the codes' fifth bits (16).
constexpr bool fifth_bits(Kind kind) { return kind == Kind::Q5_0 || kind == Kind::Q5_K; }
constexpr int64_t record_scales(Kind kind) { return kind == Kind::Q4_1 || sub_scales(kind) ? 32 : 16; }
constexpr int64_t scale_blocks(Kind kind) { return sub_scales(kind) || kind == Kind::Q6_K ? 8 : 1; }
// Whether the kind adds a min term m_w x d_x x s_x per block (ds below).
constexpr bool has_min(Kind kind) { return kind == Kind::Q4_1 || sub_scales(kind); }

struct Problem {
  Kind kind;
  const uint8_t* codes;    // [Mp / 16][Kb][record_bytes]
  const uint16_t* scales;  // [Mp / 16][Kb / scale_blocks][record_scales] fp16 bits
  // The rows quantized, block-major (a block's rows side by side, one pointer reaches a tile's):
  const int8_t* qx;        // [Kb][N][32] the rows' int8 codes
  const float* dx;         // [Kb][N] their scales d_x
  const int32_t* start;    // [Kb][N] the integer dots' start: -offset * s_x (the kernel's offset)
  const float* ds;         // [Kb][N] d_x * s_x, the min's factor (Q4_1, Q4_K, Q5_K; else null)
  const int32_t* halves;   // [Kb][N][2] Q6_K on VNNI: -32 * the sums of q_x over inputs 0-15 and 16-31
  const float* bias;       // [M] float32 or null
  float* f32;              // [N][M] float32 outputs, or null (then bf16)
  uint16_t* bf16;          // [N][M] bf16 outputs, or null
  int64_t n, m, kb;
};

// Records (groups of 16 outputs) [begin, end) of p, all rows, on the calling thread.
void vnni_groups(const Problem& p, int64_t begin, int64_t end);  // the AVX-512 build
void avx2_groups(const Problem& p, int64_t begin, int64_t end);  // every build

}  // namespace mtplm::quant
