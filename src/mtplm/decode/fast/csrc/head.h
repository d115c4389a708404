// What head.cpp (the op: the rows quantized, the candidates, the exact argmax) and its bounds per ISA
// (head_avx512.cpp: AMX and AVX-512 VNNI; head_avx2.cpp: AVX2) share.
#pragma once

#include <cstdint>
#include <vector>

namespace mtplm::head {

constexpr int kBlock = 16;
constexpr int kMaxRows = 16;  // rows one call takes (greedy.py gives more to the full head)

struct Rows {  // the hidden rows quantized: [N, Dp] codes per level, and per row s1, s2, e_h, |h|_1
  std::vector<int8_t> high, low;     // AMX: two int8 levels
  std::vector<int16_t> wide;         // otherwise: one int16 level (scale in s1, s2 = 0)
  float s1[kMaxRows], s2[kMaxRows], residual[kMaxRows], l1[kMaxRows];
  int64_t n, dp;
};

struct Head {  // the int8 copy: codes and per token [4, Vp] float32 stats; v real tokens, mask_id never chosen
  const int8_t* codes;
  const float *scale, *residual, *spread, *largest;  // s_t, r_t, a_t, 127 s_t + r_t (>= max_k |W_tk|)
  int64_t vp, dp, v, mask_id;
};

// Token blocks [begin, end) of the head: every token's upper bound into upper [N, Vp], each row r's largest
// lower and upper bound maxed into lower[r] and higher[r].
void amx_bounds(const Rows& x, const Head& hd, int64_t begin, int64_t end, float* upper, float* lower,
                float* higher);
void avx512_bounds(const Rows& x, const Head& hd, int64_t begin, int64_t end, float* upper, float* lower,
                   float* higher);
void avx2_bounds(const Rows& x, const Head& hd, int64_t begin, int64_t end, float* upper, float* lower,
                 float* higher);

}  // namespace mtplm::head
