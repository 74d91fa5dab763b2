// y[M, N] = x[M, K] W^T with W kept in a GGUF file's own blocks (Q4_0, Q4_1, Q8_0), float32 throughout.
//
// Row-invariant by construction: each output element y[m, n] is computed by the same instructions in the same
// order whatever M, the row's place among the M rows, and the thread count:
//   - threads split the output columns n (at::parallel_for: torch's own OpenMP team), never K;
//   - the weight row n is dequantized exactly (w = d*q + m: d*q is exact in float32, so one rounding, the same
//     with or without FMA) into a float buffer, then each row m accumulates 16 lanes, lane l holding
//     sum over k = l, l+16, l+32, ... of x[m,k]*w[k] by fused multiply-adds in increasing k, and the 16 lanes are
//     summed by one fixed tree (8, 4, 2, 1 apart);
//   - the AVX-512, AVX2 and scalar paths compute exactly that (the AVX2 path keeps the 16 lanes as two 8-lane
//     halves, the scalar one calls std::fma), so all three give the same bits; rows are tiled only to keep
//     accumulators in registers, and a tile never mixes rows.
// Built without -ffast-math and with -ffp-contract=off (workers/kernels/gguf_blocks.py), so the compiler fuses or
// reorders nothing on its own. The SIMD paths are compiled with target attributes and chosen at run time from the
// CPU's flags (__builtin_cpu_supports), so the library itself runs on any x86-64.
#include "gguf_blocks.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>


namespace {
using namespace specserve_gguf;

// Weight row (K / 32 blocks) -> w[K] float32, exactly (shared by every path: its arithmetic is exact or one
// rounding of an exact product plus m, so vectorising it would not change a bit; the compiler may).
void dequantize_row(const uint8_t* row, int64_t k, int64_t qtype, float* w) {
  const int64_t bb = block_bytes(qtype);
  for (int64_t b = 0; b < k / kBlock; ++b, row += bb, w += kBlock) {
    const float d = half_to_float(load_u16(row));
    if (qtype == Q8_0) {
      const int8_t* q = reinterpret_cast<const int8_t*>(row + 2);
      for (int j = 0; j < 32; ++j) w[j] = d * float(q[j]);
    } else if (qtype == Q4_1) {
      const float m = half_to_float(load_u16(row + 2));
      const uint8_t* q = row + 4;
      for (int j = 0; j < 16; ++j) { w[j] = d * float(q[j] & 0x0F) + m; w[j + 16] = d * float(q[j] >> 4) + m; }
    } else {
      const uint8_t* q = row + 2;
      for (int j = 0; j < 16; ++j) { w[j] = d * float((q[j] & 0x0F) - 8); w[j + 16] = d * float((q[j] >> 4) - 8); }
    }
  }
}

// --- the dot products of one dequantized weight row with R rows of x (y[m * ldy] for each row m) ---
template <int R>
void dots_scalar(const float* w, const float* x, int64_t k, float* y, int64_t ldy) {
  float acc[R][kLanes] = {};
  for (int64_t i = 0; i < k; i += kLanes)
    for (int r = 0; r < R; ++r)
      for (int l = 0; l < kLanes; ++l) acc[r][l] = std::fma(x[r * k + i + l], w[i + l], acc[r][l]);
  for (int r = 0; r < R; ++r) y[r * ldy] = lane_sum(acc[r]);
}

template <int R>
void dots_skewed(const float* w, const float* x, int64_t k, float* y, int64_t ldy) {
  float acc[R][kLanes] = {};
  for (int64_t i = 0; i < k; i += kLanes)
    for (int r = 0; r < R; ++r)
      for (int l = 0; l < kLanes; ++l) acc[r][l] = std::fma(x[r * k + i + l], w[i + l], acc[r][l]);
  for (int r = 0; r < R; ++r) {
    float s = 0.0f;
    for (int l = 0; l < kLanes; ++l) s += acc[r][l];  // sequential, not the tree: another order
    y[r * ldy] = s;
  }
}

#ifdef SPECSERVE_X86
template <int R, int NB>
__attribute__((target("avx2,fma"))) void dots_avx2(const float* w, const float* x, int64_t k, float* y,
                                                   int64_t ldy) {
  static_assert(NB == 1, "AVX2 has registers for one weight row");
  __m256 lo[R], hi[R];
  for (int r = 0; r < R; ++r) { lo[r] = _mm256_setzero_ps(); hi[r] = _mm256_setzero_ps(); }
  for (int64_t i = 0; i < k; i += kLanes) {
    const __m256 w0 = _mm256_loadu_ps(w + i), w1 = _mm256_loadu_ps(w + i + 8);
    for (int r = 0; r < R; ++r) {
      lo[r] = _mm256_fmadd_ps(_mm256_loadu_ps(x + r * k + i), w0, lo[r]);
      hi[r] = _mm256_fmadd_ps(_mm256_loadu_ps(x + r * k + i + 8), w1, hi[r]);
    }
  }
  for (int r = 0; r < R; ++r) y[r * ldy] = tree_sum(lo[r], hi[r]);
}

// NB weight rows (stride k) at once: each x load serves NB output columns (y[r * ldy + c]).
// y[r, c] = the fixed lane tree of acc[r][c], for every row r and weight row c of a tile (both AVX-512 kernels).
template <int R, int NB>
__attribute__((target("avx512f"))) inline void store_sums(__m512 (&acc)[R][NB], float* y, int64_t ldy) {
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < NB; ++c) {
      const __m256 lo = _mm512_castps512_ps256(acc[r][c]);
      const __m256 hi = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(acc[r][c]), 1));
      y[r * ldy + c] = tree_sum(lo, hi);
    }
}

template <int R, int NB>
__attribute__((target("avx512f"))) void dots_avx512(const float* w, const float* x, int64_t k, float* y,
                                                    int64_t ldy) {
  __m512 acc[R][NB];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < NB; ++c) acc[r][c] = _mm512_setzero_ps();
  for (int64_t i = 0; i < k; i += kLanes) {
    __m512 wv[NB];
    for (int c = 0; c < NB; ++c) wv[c] = _mm512_loadu_ps(w + c * k + i);
    for (int r = 0; r < R; ++r) {
      const __m512 xv = _mm512_loadu_ps(x + r * k + i);
      for (int c = 0; c < NB; ++c) acc[r][c] = _mm512_fmadd_ps(xv, wv[c], acc[r][c]);
    }
  }
  store_sums<R, NB>(acc, y, ldy);
}

// Few rows (M <= kFusedRows) of Q4 weights: the weights are decoded in registers inside the dot loop (no buffer),
// NB weight rows a pass; per output element the same fused multiply-adds in the same order as dots_avx512 (checked
// equal). Q8_0 stays on the buffered path: decoded this way it measured 2.5x slower at one row (the head, 49,152
// x 576), for reasons not found.
template <int64_t Q, int R, int NB>
__attribute__((target("avx512f,f16c"))) void fused_avx512(const uint8_t* wrow, int64_t row_bytes, const float* x,
                                                          int64_t k, float* y, int64_t ldy) {
  static_assert(Q == Q4_0 || Q == Q4_1, "Q4 blocks only");
  constexpr int64_t bb = Q == Q4_1 ? 20 : 18;
  const __m512 iota = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  __m512 acc[R][NB];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < NB; ++c) acc[r][c] = _mm512_setzero_ps();
  const uint8_t* blk = wrow;
  for (int64_t i = 0; i < k; i += kBlock, blk += bb) {
    __m512 table[NB];  // the 16 values a nibble decodes to
    __m512i q[NB];     // the 16 bytes of nibbles, one a lane
    for (int c = 0; c < NB; ++c) {
      const uint8_t* b = blk + c * row_bytes;
      const __m512 d = _mm512_set1_ps(_cvtsh_ss(load_u16(b)));
      if constexpr (Q == Q4_1) {
        table[c] = _mm512_fmadd_ps(d, iota, _mm512_set1_ps(_cvtsh_ss(load_u16(b + 2))));
        q[c] = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 4)));
      } else {
        table[c] = _mm512_mul_ps(d, _mm512_sub_ps(iota, _mm512_set1_ps(8.0f)));
        q[c] = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 2)));
      }
    }
    for (int h = 0; h < 2; ++h) {  // weights i .. i + 15, then i + 16 .. i + 31
      __m512 wv[NB];
      for (int c = 0; c < NB; ++c) wv[c] = _mm512_permutexvar_ps(h ? _mm512_srli_epi32(q[c], 4) : q[c], table[c]);
      for (int r = 0; r < R; ++r) {
        const __m512 xv = _mm512_loadu_ps(x + r * k + i + 16 * h);
        for (int c = 0; c < NB; ++c) acc[r][c] = _mm512_fmadd_ps(xv, wv[c], acc[r][c]);
      }
    }
  }
  store_sums<R, NB>(acc, y, ldy);
}

using Fused = void (*)(const uint8_t*, int64_t, const float*, int64_t, float*, int64_t);
constexpr int kFusedRows = 8;  // up to 4 rows: 4 weight rows a pass (16 accumulators); 5-8 rows: 2 (up to 16)

template <int64_t Q>
Fused fused_for(int rows, int nb) {
#define SPECSERVE_F(R) \
  case R: return nb == 1 ? fused_avx512<Q, R, 1> : nb == 2 ? fused_avx512<Q, R, 2> : fused_avx512<Q, (R > 4 ? 4 : R), 4>;
  switch (rows) { SPECSERVE_F(1) SPECSERVE_F(2) SPECSERVE_F(3) SPECSERVE_F(4) SPECSERVE_F(5) SPECSERVE_F(6)
                  SPECSERVE_F(7) SPECSERVE_F(8) }
#undef SPECSERVE_F
  return nullptr;
}

Fused fused_kernel(int64_t qtype, int rows, int nb) {
  return qtype == Q4_1 ? fused_for<Q4_1>(rows, nb) : fused_for<Q4_0>(rows, nb);
}

// The same dequantization, vectorised (exact arithmetic: the bits equal dequantize_row's; d q is exact in
// float32, so d q + m rounds once whether fused or not).
__attribute__((target("avx512f,f16c"))) void dequantize_row_avx512(const uint8_t* row, int64_t k, int64_t qtype,
                                                                  float* w) {
  const int64_t bb = block_bytes(qtype);
  const __m512 iota = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  for (int64_t b = 0; b < k / kBlock; ++b, row += bb, w += kBlock) {
    const __m512 d = _mm512_set1_ps(_cvtsh_ss(load_u16(row)));
    if (qtype == Q8_0) {
      const __m128i q0 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(row + 2));
      const __m128i q1 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(row + 18));
      _mm512_storeu_ps(w, _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(q0))));
      _mm512_storeu_ps(w + 16, _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(q1))));
      continue;
    }
    // The 16 values a nibble can decode to, d q + m (Q4_1) or d (q - 8) (Q4_0), then looked up by nibble
    // (vpermps reads an index's low 4 bits, so the low nibbles need no mask).
    const bool q41 = qtype == Q4_1;
    const __m512 table = q41 ? _mm512_fmadd_ps(d, iota, _mm512_set1_ps(_cvtsh_ss(load_u16(row + 2))))
                             : _mm512_mul_ps(d, _mm512_sub_ps(iota, _mm512_set1_ps(8.0f)));
    const __m512i q = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(row + (q41 ? 4 : 2))));
    _mm512_storeu_ps(w, _mm512_permutexvar_ps(q, table));
    _mm512_storeu_ps(w + 16, _mm512_permutexvar_ps(_mm512_srli_epi32(q, 4), table));
  }
}

__attribute__((target("avx2,f16c"))) void dequantize_row_avx2(const uint8_t* row, int64_t k, int64_t qtype,
                                                             float* w) {
  const int64_t bb = block_bytes(qtype);
  const __m128i low = _mm_set1_epi8(0x0F);
  for (int64_t b = 0; b < k / kBlock; ++b, row += bb, w += kBlock) {
    const __m256 d = _mm256_set1_ps(_cvtsh_ss(load_u16(row)));
    if (qtype == Q8_0) {
      for (int j = 0; j < 32; j += 8) {
        const __m128i q = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(row + 2 + j));
        _mm256_storeu_ps(w + j, _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q))));
      }
      continue;
    }
    const bool q41 = qtype == Q4_1;
    const __m128i q = _mm_loadu_si128(reinterpret_cast<const __m128i*>(row + (q41 ? 4 : 2)));
    const __m128i nib[2] = {_mm_and_si128(q, low), _mm_and_si128(_mm_srli_epi16(q, 4), low)};
    const __m256 m = q41 ? _mm256_set1_ps(_cvtsh_ss(load_u16(row + 2))) : _mm256_setzero_ps();
    const __m256 eight = _mm256_set1_ps(8.0f);
    for (int h = 0; h < 2; ++h)
      for (int j = 0; j < 16; j += 8) {
        const __m128i src = j ? _mm_srli_si128(nib[h], 8) : nib[h];  // bytes j .. j + 7 of this half
        __m256 v = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(src));
        v = q41 ? _mm256_add_ps(_mm256_mul_ps(d, v), m) : _mm256_mul_ps(d, _mm256_sub_ps(v, eight));
        _mm256_storeu_ps(w + h * 16 + j, v);
      }
  }
}
#endif

using Dequantize = void (*)(const uint8_t*, int64_t, int64_t, float*);

Dequantize dequantizer(int64_t isa) {
#ifdef SPECSERVE_X86
  if (isa == kAvx512) return dequantize_row_avx512;
  if (isa == kAvx2) return dequantize_row_avx2;
#endif
  return dequantize_row;
}

using Dots = void (*)(const float*, const float*, int64_t, float*, int64_t);

#define SPECSERVE_TILES(fn) {fn<1>, fn<2>, fn<3>, fn<4>, fn<5>, fn<6>, fn<7>, fn<8>}
#define SPECSERVE_TILES_NB(fn, nb) {fn<1, nb>, fn<2, nb>, fn<3, nb>, fn<4, nb>, fn<5, nb>, fn<6, nb>, \
                                    fn<7, nb>, fn<8, nb>}
constexpr int kTile = 8;  // rows per register tile, one weight row (the last tile of a call may be shorter)
constexpr int kWide = 4;  // weight rows per AVX-512 pass (R rows x 4 columns of accumulators)
constexpr int kWideTile = 6;  // rows per such pass: 24 accumulators + 4 weights + 1 x of 32 registers

const Dots* tiles(int64_t isa, int64_t m) {
  static const Dots scalar[kTile] = SPECSERVE_TILES(dots_scalar);
  static const Dots skewed[kTile] = SPECSERVE_TILES(dots_skewed);
  if (isa == kSkewed) return m > 1 ? skewed : scalar;
#ifdef SPECSERVE_X86
  static const Dots avx2[kTile] = SPECSERVE_TILES_NB(dots_avx2, 1);
  static const Dots avx512[kTile] = SPECSERVE_TILES_NB(dots_avx512, 1);
  if (isa == kAvx512) return avx512;
  if (isa == kAvx2) return avx2;
#endif
  return scalar;
}

const Dots* wide_tiles(int64_t isa) {  // kWide weight rows a pass, up to kWideTile rows; null: not on this path
#ifdef SPECSERVE_X86
  static const Dots avx512[kWideTile] = {dots_avx512<1, kWide>, dots_avx512<2, kWide>, dots_avx512<3, kWide>,
                                         dots_avx512<4, kWide>, dots_avx512<5, kWide>, dots_avx512<6, kWide>};
  if (isa == kAvx512) return avx512;
#endif
  return nullptr;
}

// x [M, K] float32, blocks [N, K / 32 * block bytes] uint8 -> y [M, N] float32.
at::Tensor block_mm(const at::Tensor& x_in, const at::Tensor& blocks, int64_t qtype, int64_t isa) {
  TORCH_CHECK(x_in.dim() == 2 && x_in.scalar_type() == at::kFloat && x_in.device().is_cpu(), "x: [M, K] float32 CPU");
  TORCH_CHECK(blocks.dim() == 2 && blocks.scalar_type() == at::kByte && blocks.is_contiguous(), "blocks: [N, bytes] uint8");
  const at::Tensor x = x_in.contiguous();
  const int64_t m = x.size(0), k = x.size(1), n = blocks.size(0), bb = block_bytes(qtype);
  TORCH_CHECK(k % kBlock == 0 && blocks.size(1) == k / kBlock * bb, "blocks do not hold ", k, " weights a row");
  at::Tensor y = at::empty({m, n}, x.options());
  if (m == 0 || n == 0) return y;
  int64_t chosen = resolve_isa(isa);
  if (chosen == kAvx512Vnni) chosen = kAvx512;  // float32 activations: no integer dot products
  const Dots* dots = tiles(chosen, m);
  const Dequantize dequantize = dequantizer(chosen);
  const float* xp = x.data_ptr<float>();
  const uint8_t* wp = blocks.data_ptr<uint8_t>();
  float* yp = y.data_ptr<float>();
  const int64_t row_bytes = blocks.size(1);
  const Dots* wide = wide_tiles(chosen);
#ifdef SPECSERVE_X86
  if (chosen == kAvx512 && m <= kFusedRows && qtype != Q8_0) {
    const int widest = m <= 4 ? 4 : 2;  // weight rows a pass (accumulators: rows x weight rows <= 16)
    Fused fns[5] = {nullptr, fused_kernel(qtype, int(m), 1), fused_kernel(qtype, int(m), 2), nullptr,
                    fused_kernel(qtype, int(m), 4)};
    at::parallel_for(0, n, 16, [&](int64_t begin, int64_t end) {
      for (int64_t j = begin; j < end;) {
        const int nb = end - j >= widest ? widest : end - j >= 2 ? 2 : 1;
        fns[nb](wp + j * row_bytes, row_bytes, xp, k, yp + j, n);
        j += nb;
      }
    });
    return y;
  }
#endif
  at::parallel_for(0, n, 16, [&](int64_t begin, int64_t end) {
    std::vector<float> w(kWide * k);  // kWide dequantized weight rows
    for (int64_t j = begin; j < end;) {
      const int64_t nb = wide != nullptr && end - j >= kWide ? kWide : 1;
      for (int64_t c = 0; c < nb; ++c) dequantize(wp + (j + c) * row_bytes, k, qtype, w.data() + c * k);
      const int tile = nb == kWide ? kWideTile : kTile;
      for (int64_t r = 0; r < m; r += tile) {
        const int64_t rows = std::min<int64_t>(tile, m - r);
        (nb == kWide ? wide : dots)[rows - 1](w.data(), xp + r * k, k, yp + r * n + j, n);
      }
      j += nb;
    }
  });
  return y;
}

// The rows ``ids`` [T] of the dequantized matrix -> [T, K] float32 (an embedding lookup).
at::Tensor block_rows(const at::Tensor& blocks, const at::Tensor& ids_in, int64_t qtype) {
  TORCH_CHECK(blocks.dim() == 2 && blocks.scalar_type() == at::kByte && blocks.is_contiguous(), "blocks: [N, bytes] uint8");
  const at::Tensor ids = ids_in.to(at::kLong).contiguous();
  const int64_t bb = block_bytes(qtype), row_bytes = blocks.size(1), k = row_bytes / bb * kBlock, t = ids.numel();
  at::Tensor out = at::empty({t, k}, blocks.options().dtype(at::kFloat));
  const int64_t* ip = ids.data_ptr<int64_t>();
  for (int64_t i = 0; i < t; ++i) {
    TORCH_CHECK(ip[i] >= 0 && ip[i] < blocks.size(0), "row id ", ip[i], " out of range");
    dequantize_row(blocks.data_ptr<uint8_t>() + ip[i] * row_bytes, k, qtype, out.data_ptr<float>() + i * k);
  }
  return out;
}

int64_t block_isa() { return best_isa(); }

}  // namespace

TORCH_LIBRARY(specserve_gguf, m) {
  m.def("mm(Tensor x, Tensor blocks, int qtype, int isa=-1) -> Tensor", &block_mm);
  m.def("rows(Tensor blocks, Tensor ids, int qtype) -> Tensor", &block_rows);
  m.def("best_isa() -> int", &block_isa);
}
