// Decode attention through AMX tiles: attend.cpp's op takes this path for bf16 stores with head dim 64 where
// the CPU has AMX, with the same guarantee: a row's output depends only on its query and the keys it reads, in
// their order (not on the rows beside it, the pass's key count or masked keys between the ones it reads).
//   scores   one tile product gives 16 keys' dots with up to 16 rows (key k, row r at s[k][r]); the tile unit
//            sums each (key, row) dot alone, in one order whatever its place in the tile
//   softmax  the rows in the lanes: scaling, mask, max, exp as attend.cpp does them, element by element
//   values   a tile product over p split into bf16 high and low parts (p = high + low to ~2^-17) and the
//            values of 32 keys interleaved by pairs; each row's total key by key, in key order (float32).
//            The tile sums keys by their places, so a row whose keys have masked keys between them (a draft
//            tree's branch) runs again over its own keys packed together, as plain decoding holds them.

#include "attend.h"
#include "fewrow.h"

#include <algorithm>
#include <cstring>
#include <vector>

namespace mtplm::attend {
namespace {

using mtplm::fewrow::before_tile_loads;
using mtplm::fewrow::TileConfig;

// s[k][r] (16 floats a key) = q_r . k_j for the first `reach` keys (a last partial block's keys past reach
// read as zeros); rows <= 16, d = 64. Tiles: 0, 1 a block's keys (d halves), 2, 3 the rows' query pairs,
// 4 the dots.
__attribute__((target("amx-tile,amx-bf16")))
void amx_dots(const uint16_t* keys, int64_t reach, const uint16_t* const* q, int rows, float* s) {
  alignas(64) uint32_t pairs[32][16] = {};  // pairs[i][r]: row r's elements 2i, 2i + 1
  for (int r = 0; r < rows; ++r)
    for (int i = 0; i < 32; ++i) std::memcpy(&pairs[i][r], q[r] + 2 * i, sizeof(uint32_t));
  before_tile_loads();
  _tile_loadd(2, pairs[0], 64);
  _tile_loadd(3, pairs[16], 64);
  alignas(64) uint16_t tail[16 * 64];
  for (int64_t j = 0; j < reach; j += 16) {
    const uint16_t* block = keys + j * 64;
    if (j + 16 > reach) {
      std::memset(tail, 0, sizeof(tail));
      std::memcpy(tail, block, (reach - j) * 64 * sizeof(uint16_t));
      block = tail;
      before_tile_loads();
    }
    ahead(keys + (j + kPrefetchKeys) * 64, 16 * 64);
    _tile_zero(4);
    _tile_loadd(0, block, 128);
    _tile_loadd(1, block + 32, 128);
    _tile_dpbf16ps(4, 0, 2);
    _tile_dpbf16ps(4, 1, 3);
    _tile_stored(4, s + j * 16, 64);
  }
}

// s[j][r] -> p: scaling * s + mask_r[j], then exp(. - the row's max), rows in the lanes. A block of 16 keys
// whose masks are all 0 for these rows skips the mask (x + 0 is x).
void lane_probabilities(const Head<uint16_t>& h, const float* const* mask, int rows, float* s) {
  const __m512 scaling = _mm512_set1_ps(h.scaling);
  alignas(64) int32_t offsets[16] = {};
  for (int r = 0; r < rows; ++r) offsets[r] = static_cast<int32_t>(mask[r] - mask[0]);
  const __m512i index = _mm512_load_si512(offsets);
  const __mmask16 live = lanes(rows);
  __m512 top = _mm512_set1_ps(-__FLT_MAX__);
  for (int64_t j = 0; j < h.t; j += 16) {
    const int64_t n = std::min<int64_t>(16, h.t - j);
    bool open = true;  // every row reads every key of the block
    for (int r = 0; r < rows && open; ++r) {
      const __m512 block = _mm512_maskz_loadu_ps(lanes(n), mask[r] + j);
      open = _mm512_mask_cmpneq_ps_mask(lanes(n), block, _mm512_setzero_ps()) == 0;
    }
    for (int64_t k = j; k < j + n; ++k) {
      __m512 x = _mm512_mul_ps(_mm512_loadu_ps(s + k * 16), scaling);
      if (!open)
        x = _mm512_add_ps(x, _mm512_mask_i32gather_ps(_mm512_setzero_ps(), live, index, mask[0] + k, 4));
      _mm512_storeu_ps(s + k * 16, x);
      top = _mm512_mask_max_ps(top, live, top, x);
    }
  }
  for (int64_t k = 0; k < h.t; ++k)
    _mm512_storeu_ps(s + k * 16, exp_nonpositive(_mm512_sub_ps(_mm512_loadu_ps(s + k * 16), top)));
}

// Accumulator tiles 4-7 (row r, output columns) += sum over keys [0, count) of p[16 k + r] v_k, in tiles of
// 32 keys from key 0: p split into bf16 high and low parts (p = high + low to ~2^-17), the values of 32 keys
// interleaved by pairs (the B tile's layout). Keys past count read as zero (p must be zero there up to a
// multiple of 32). Tiles: 0, 1 high and low p, 2, 3 values.
__attribute__((target("amx-tile,amx-bf16,avx512f,avx512bw,avx512vl,avx512bf16")))
void accumulate(const float* p, const uint16_t* values, int64_t count, int rows) {
  alignas(64) uint16_t high[16][32] = {}, low[16][32] = {}, pairs[4][16][32];
  const __m512i key = _mm512_setr_epi32(0, 16, 32, 48, 64, 80, 96, 112, 128, 144, 160, 176, 192, 208, 224, 240);
  __m512i interleave[2];  // columns 16b .. 16b + 15 of two keys' 32, as (first key's, second key's) pairs
  for (int b = 0; b < 2; ++b) {
    alignas(64) int16_t index[32];
    for (int c = 0; c < 16; ++c) index[2 * c] = int16_t(16 * b + c), index[2 * c + 1] = int16_t(32 + 16 * b + c);
    interleave[b] = _mm512_load_si512(index);
  }
  for (int64_t j = 0; j < count; j += 32) {
    for (int r = 0; r < rows; ++r) {
      const __m512 x0 = _mm512_i32gather_ps(key, p + j * 16 + r, 4);  // row r's p of keys j .. j + 15
      const __m512 x1 = _mm512_i32gather_ps(key, p + (j + 16) * 16 + r, 4);
      const __m512i top = (__m512i)_mm512_cvtne2ps_pbh(x1, x0);  // keys j .. j + 15 in the low half
      const __m512 t0 = load16(reinterpret_cast<const uint16_t*>(&top));
      const __m512 t1 = load16(reinterpret_cast<const uint16_t*>(&top) + 16);
      _mm512_store_si512(high[r], top);
      _mm512_store_si512(low[r], (__m512i)_mm512_cvtne2ps_pbh(_mm512_sub_ps(x1, t1), _mm512_sub_ps(x0, t0)));
    }
    for (int i = 0; i < 16; ++i) {
      const int64_t a = j + 2 * i, b = a + 1;
      const __m512i zero = _mm512_setzero_si512();
      const uint16_t* va = values + a * 64;
      const uint16_t* vb = values + b * 64;
      const __m512i a0 = a < count ? _mm512_loadu_si512(va) : zero, a1 = a < count ? _mm512_loadu_si512(va + 32) : zero;
      const __m512i b0 = b < count ? _mm512_loadu_si512(vb) : zero, b1 = b < count ? _mm512_loadu_si512(vb + 32) : zero;
      _mm512_store_si512(pairs[0][i], _mm512_permutex2var_epi16(a0, interleave[0], b0));
      _mm512_store_si512(pairs[1][i], _mm512_permutex2var_epi16(a0, interleave[1], b0));
      _mm512_store_si512(pairs[2][i], _mm512_permutex2var_epi16(a1, interleave[0], b1));
      _mm512_store_si512(pairs[3][i], _mm512_permutex2var_epi16(a1, interleave[1], b1));
    }
    before_tile_loads();
    _tile_loadd(0, high, 64);
    _tile_loadd(1, low, 64);
    // column block c into tile 4 + c; tiles 2 and 3 take turns (tile numbers must be literals: GCC's tile
    // intrinsics name the register in their assembly)
    _tile_loadd(2, pairs[0], 64);
    _tile_dpbf16ps(4, 0, 2);
    _tile_dpbf16ps(4, 1, 2);
    _tile_loadd(3, pairs[1], 64);
    _tile_dpbf16ps(5, 0, 3);
    _tile_dpbf16ps(5, 1, 3);
    _tile_loadd(2, pairs[2], 64);
    _tile_dpbf16ps(6, 0, 2);
    _tile_dpbf16ps(6, 1, 2);
    _tile_loadd(3, pairs[3], 64);
    _tile_dpbf16ps(7, 0, 3);
    _tile_dpbf16ps(7, 1, 3);
  }
}

using Sums = float[16][64];  // a task's value sums: row r, output column c

__attribute__((target("amx-tile,amx-bf16")))
void store_sums(Sums& sums) {
  _tile_stored(4, &sums[0][0], 256);
  _tile_stored(5, &sums[0][16], 256);
  _tile_stored(6, &sums[0][32], 256);
  _tile_stored(7, &sums[0][48], 256);
}

__attribute__((target("amx-tile,amx-bf16")))
void load_sums(const Sums& sums) {
  before_tile_loads();
  _tile_loadd(4, &sums[0][0], 256);
  _tile_loadd(5, &sums[0][16], 256);
  _tile_loadd(6, &sums[0][32], 256);
  _tile_loadd(7, &sums[0][48], 256);
}

// The first key a row reads after a masked one (t where there is none): a row with masked keys between the
// ones it reads (a draft tree's branch) must get the sum of the same keys side by side, as plain decoding's
// pass holds them, but a tile product pairs and sums keys by their places.
int64_t first_hole(const float* mask, int64_t t) {
  const int64_t last = readable(mask, t);
  const __m512 lowest = _mm512_set1_ps(-__FLT_MAX__);
  for (int64_t j = 0; j < last; j += 16) {
    const __mmask16 in = lanes(last - j);
    const __mmask16 open = _mm512_mask_cmp_ps_mask(in, _mm512_maskz_loadu_ps(in, mask + j), lowest, _CMP_GT_OQ);
    if (open != in) return j + __builtin_ctz(static_cast<unsigned>(~open & in));
  }
  return t;
}

// Row r's sums over its readable keys from `from` (a multiple of 32) packed together, continuing from `start`
// (its sums over keys [0, from), which it reads whole).
void packed_row(const Head<uint16_t>& h, const float* mask, const float* s, int r, int64_t from, const Sums& start,
                Sums& sums) {
  thread_local std::vector<float> p;
  thread_local std::vector<uint16_t> values;
  p.assign(16 * (h.t - from + 32), 0.f);
  values.resize(64 * (h.t - from + 32));
  int64_t kept = 0;
  for (int64_t j = from; j < h.t; ++j) {
    if (!(mask[j] > -__FLT_MAX__)) continue;
    p[16 * kept] = s[16 * j + r];
    std::memcpy(values.data() + 64 * kept, h.values + 64 * j, 64 * sizeof(uint16_t));
    ++kept;
  }
  alignas(64) Sums row = {};
  std::memcpy(row[0], start[r], sizeof(row[0]));
  load_sums(row);
  accumulate(p.data(), values.data(), kept, 1);
  store_sums(sums);
}

// out[r] = sum_j p[j][r] v_j / sum_j p[j][r] (p: s after lane_probabilities, zero past t up to a multiple of 32
// keys); each row's total key by key in key order (float32). Rows with holes share the tile sums up to the
// 32-key tile of the earliest hole and continue over their own keys packed.
void amx_values(const Head<uint16_t>& h, const float* const* mask, const float* s, uint16_t* const* o, int rows) {
  int64_t holes[kRowsPerTask], shared = h.t;
  for (int r = 0; r < rows; ++r) holes[r] = first_hole(mask[r], h.t), shared = std::min(shared, holes[r] / 32 * 32);
  __m512 total = _mm512_setzero_ps();
  for (int64_t k = 0; k < h.t; ++k) total = _mm512_add_ps(total, _mm512_loadu_ps(s + k * 16));
  alignas(64) float totals[16];
  _mm512_store_ps(totals, total);
  alignas(64) Sums start = {}, sums, own;
  load_sums(start);
  accumulate(s, h.values, shared, rows);
  store_sums(start);
  accumulate(s + shared * 16, h.values + shared * 64, h.t - shared, rows);
  store_sums(sums);
  for (int r = 0; r < rows; ++r) {
    const float* row = sums[r];
    if (holes[r] < h.t) {
      packed_row(h, mask[r], s, r, shared, start, own);
      row = own[0];
    }
    const __m512 scale = _mm512_div_ps(_mm512_set1_ps(1.0f), _mm512_set1_ps(totals[r]));
    for (int c = 0; c < 4; ++c) store16(o[r] + 16 * c, _mm512_mul_ps(_mm512_load_ps(row + 16 * c), scale));
  }
}

TileConfig all_tiles() {
  TileConfig config{};
  config.palette = 1;
  for (int t = 0; t < 8; ++t) config.rows[t] = 16, config.colsb[t] = 64;
  return config;
}

}  // namespace

__attribute__((target("amx-tile,amx-bf16")))
void amx_task(const Head<uint16_t>& h, const uint16_t* const* q, const float* const* mask, uint16_t* const* o,
              int rows, float* scratch) {
  static const TileConfig config = all_tiles();
  _tile_loadconfig(&config);
  amx_dots(h.keys, h.t, q, rows, scratch);
  lane_probabilities(h, mask, rows, scratch);
  const int64_t padded = (h.t + 31) / 32 * 32;
  std::memset(scratch + h.t * 16, 0, (padded - h.t) * 16 * sizeof(float));
  amx_values(h, mask, scratch, o, rows);
  _tile_release();
}

}  // namespace mtplm::attend
