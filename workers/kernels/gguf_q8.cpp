// y[M, N] = q8(x)[M, K] W^T with W in a GGUF file's own blocks (Q4_0, Q4_1, Q8_0) and the activations quantized
// per row and per 32-block to 8 bits, as llama.cpp computes these formats (its Q8_0 / Q8_1 activation blocks):
//   d = max|x| / 127 (stored rounded to float16, as llama.cpp stores it), q = round-half-even(x / d) in -127..127,
//   and for Q4_1's min term s = d * sum(q);
// each block's dot product is an exact integer, combined in float32 in one fixed order.
//
// Row-invariant by construction, like the float32 path (gguf_blocks.cpp):
//   - a row's quantized activations depend on that row alone (quantize_rows, one scalar function for all paths);
//   - for output y[m, n], block b's 32 products are summed as 8 integer lane sums p_l (weights 4l .. 4l + 3), exact
//     in int32 whatever instructions compute them (vpdpbusd, maddubs + madd, or a C loop); then
//     acc[8 (b & 1) + l] = fma(dw_b * dx_b, p_l, acc[...]) in increasing b (even blocks in lanes 0-7, odd ones in
//     8-15), the 16 lanes summed by the fixed tree, and + the min term sum_b fma(m_b, s_b) (Q4_1; 0 otherwise);
//   - threads split the output columns, never K; row tiles only keep accumulators in registers and never mix rows.
// So the AVX-512 VNNI, AVX2 and scalar paths give the same bits, at every M and thread count.
#include "gguf_blocks.h"

#include <ATen/Parallel.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <vector>

namespace {
using namespace specserve_gguf;

constexpr int kRowTile = 8;  // rows a pass (the AVX-512 tiles: up to 8 rows x 2 weight rows of accumulators)

// A call's activations, quantized; every entry of row r is computed from row r of x alone.
struct Q8Rows {
  int64_t m, k, g, ld_sx;      // rows, K, blocks a row, the stride of sx
  std::vector<int8_t> q;       // [M, K] the 8-bit activations
  std::vector<float> d;        // [M, G] their scale per block
  std::vector<float> dv;       // [M, G * 8] d repeated per lane (the AVX-512 path loads two blocks' 16)
  std::vector<int32_t> corr;   // [M, G * 8] -offset * (the lane's sum of 4 q): removes the weights' unsigned offset
  std::vector<float> sx;       // [G, ld_sx] s = d * sum(q) per block, the rows side by side (Q4_1's min term)
};

// The unsigned form the integer paths read a weight in is w + offset (vpdpbusd takes unsigned x signed bytes).
int offset_of(int64_t qtype) { return qtype == Q4_0 ? 8 : qtype == Q8_0 ? 128 : 0; }

Q8Rows quantize_rows(const float* x, int64_t m, int64_t k, int64_t qtype) {
  Q8Rows a;
  a.m = m; a.k = k; a.g = k / kBlock;
  a.ld_sx = (m + kRowTile - 1) / kRowTile * kRowTile + kRowTile;  // a tile's 8-lane load stays in bounds
  a.q.resize(m * k); a.d.resize(m * a.g); a.dv.resize(m * a.g * 8); a.corr.resize(m * a.g * 8);
  a.sx.assign(a.g * a.ld_sx, 0.0f);
  const int off = offset_of(qtype);
  for (int64_t r = 0; r < m; ++r)
    for (int64_t b = 0; b < a.g; ++b) {
      const float* xb = x + r * k + b * kBlock;
      float amax = 0.0f;
      for (int j = 0; j < kBlock; ++j) amax = std::max(amax, std::fabs(xb[j]));
      const float d = amax / 127.0f, id = d != 0.0f ? 1.0f / d : 0.0f;
      const float dh = float(c10::Half(d));  // the scale as llama.cpp's block stores it
      int8_t* q = a.q.data() + r * k + b * kBlock;
      int sum = 0;
      for (int j = 0; j < kBlock; ++j) {
        const int v = std::clamp(int(std::nearbyint(xb[j] * id)), -127, 127);
        q[j] = int8_t(v);
        sum += v;
      }
      a.d[r * a.g + b] = dh;
      for (int l = 0; l < 8; ++l) {
        a.dv[(r * a.g + b) * 8 + l] = dh;
        a.corr[(r * a.g + b) * 8 + l] = -off * (q[4 * l] + q[4 * l + 1] + q[4 * l + 2] + q[4 * l + 3]);
      }
      a.sx[b * a.ld_sx + r] = dh * float(sum);
    }
  return a;
}

// Block -> its 32 weights as integers (Q4_0: q - 8, Q4_1: q, Q8_0: q), its scale and (Q4_1) its min.
void decode_ints(const uint8_t* blk, int64_t qtype, int* w, float* dw, float* mw) {
  *dw = half_to_float(load_u16(blk));
  *mw = qtype == Q4_1 ? half_to_float(load_u16(blk + 2)) : 0.0f;
  if (qtype == Q8_0) {
    for (int j = 0; j < 32; ++j) w[j] = reinterpret_cast<const int8_t*>(blk + 2)[j];
    return;
  }
  const uint8_t* q = blk + (qtype == Q4_1 ? 4 : 2);
  const int sub = qtype == Q4_0 ? 8 : 0;
  for (int j = 0; j < 16; ++j) { w[j] = (q[j] & 0x0F) - sub; w[j + 16] = (q[j] >> 4) - sub; }
}

using Q8Fn = void (*)(const uint8_t*, int64_t, int64_t, const Q8Rows&, int64_t, int, float*, int64_t);

// The definition every path reproduces: output columns w .. w + nb - 1 (nb weight rows) for rows r0 .. r0 + rows.
// skew: the test-only variant that sums the lanes in another order when the call has more than one row.
template <bool Skew>
void q8_scalar(const uint8_t* wrow, int64_t row_bytes, int64_t qtype, const Q8Rows& a, int64_t r0, int rows,
               float* y, int64_t ldy) {
  const int64_t bb = block_bytes(qtype);
  int w[32];
  for (int r = 0; r < rows; ++r) {
    float acc[kLanes] = {}, accm = 0.0f, dw, mw;
    const int64_t row = r0 + r;
    for (int64_t b = 0; b < a.g; ++b) {
      decode_ints(wrow + b * bb, qtype, w, &dw, &mw);
      const float d = dw * a.d[row * a.g + b];
      const int8_t* xq = a.q.data() + row * a.k + b * kBlock;
      for (int l = 0; l < 8; ++l) {
        int p = 0;
        for (int t = 4 * l; t < 4 * l + 4; ++t) p += w[t] * xq[t];
        acc[8 * (b & 1) + l] = std::fma(d, float(p), acc[8 * (b & 1) + l]);
      }
      accm = std::fma(mw, a.sx[b * a.ld_sx + row], accm);
    }
    float s = 0.0f;
    if (Skew && a.m > 1) {
      for (int l = 0; l < kLanes; ++l) s += acc[l];
    } else {
      s = lane_sum(acc);
    }
    y[r * ldy] = s + accm;
  }
}

#ifdef SPECSERVE_X86
// One weight row, rows r0 .. r0 + rows: maddubs (unsigned x signed bytes) + madd give the 8 lane sums.
__attribute__((target("avx2,fma,f16c"))) void q8_avx2(const uint8_t* wrow, int64_t row_bytes, int64_t qtype,
                                                      const Q8Rows& a, int64_t r0, int rows, float* y,
                                                      int64_t ldy) {
  const int64_t bb = block_bytes(qtype);
  const __m256i ones = _mm256_set1_epi16(1), low = _mm256_set1_epi8(0x0F);
  __m256 acc[kRowTile][2];
  float accm[kRowTile] = {};
  for (int r = 0; r < rows; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
  for (int64_t b = 0; b < a.g; ++b) {
    const uint8_t* blk = wrow + b * bb;
    const float dw = _cvtsh_ss(load_u16(blk)), mw = qtype == Q4_1 ? _cvtsh_ss(load_u16(blk + 2)) : 0.0f;
    __m256i u;  // Q4: the nibbles 0..15 in weight order; Q8_0: the weights themselves (signed)
    if (qtype == Q8_0) {
      u = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 2));
    } else {
      const __m128i q = _mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + (qtype == Q4_1 ? 4 : 2)));
      u = _mm256_and_si256(_mm256_inserti128_si256(_mm256_castsi128_si256(q), _mm_srli_epi16(q, 4), 1), low);
    }
    const __m256i uabs = qtype == Q8_0 ? _mm256_sign_epi8(u, u) : u;
    for (int r = 0; r < rows; ++r) {
      const int64_t row = r0 + r;
      __m256i xq = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a.q.data() + row * a.k + b * kBlock));
      if (qtype == Q8_0) xq = _mm256_sign_epi8(xq, u);  // |w| x sign(w) x: products <= 128 * 127, no saturation
      __m256i p = _mm256_madd_epi16(_mm256_maddubs_epi16(uabs, xq), ones);  // [8] int32 lane sums
      if (qtype == Q4_0)
        p = _mm256_add_epi32(p, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a.corr.data() + (row * a.g + b) * 8)));
      const __m256 d = _mm256_set1_ps(dw * a.d[row * a.g + b]);
      acc[r][b & 1] = _mm256_fmadd_ps(d, _mm256_cvtepi32_ps(p), acc[r][b & 1]);
      accm[r] = std::fma(mw, a.sx[b * a.ld_sx + row], accm[r]);
    }
  }
  for (int r = 0; r < rows; ++r) y[r * ldy] = tree_sum(acc[r][0], acc[r][1]) + accm[r];
}

// Two blocks a 512-bit register: unsigned weights (w + offset) by vpdpbusd against the signed activations, from
// the lane sums' correction -offset * sum(q), so p_l is the same exact integer as the scalar definition.
template <int64_t Q>
__attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni,fma"))) inline __m512i unsigned_pair(const uint8_t* p0,
                                                                                               const uint8_t* p1) {
  if constexpr (Q == Q8_0) {
    const __m512i t = _mm512_inserti64x4(
        _mm512_castsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p0 + 2))),
        _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p1 + 2)), 1);
    return _mm512_xor_si512(t, _mm512_set1_epi8(char(0x80)));
  } else {
    constexpr int64_t off = Q == Q4_1 ? 4 : 2;
    const __m128i a0 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p0 + off));
    const __m128i a1 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p1 + off));
    __m512i t = _mm512_inserti32x4(_mm512_castsi128_si512(a0), a0, 1);
    t = _mm512_inserti32x4(_mm512_inserti32x4(t, a1, 2), a1, 3);  // 128-bit lanes: a0, a0, a1, a1
    t = _mm512_mask_blend_epi64(0xCC, t, _mm512_srli_epi16(t, 4));  // lanes 1 and 3: the high nibbles
    return _mm512_and_si512(t, _mm512_set1_epi8(0x0F));
  }
}

template <int64_t Q>
__attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni,fma"))) inline __m256i unsigned_one(const uint8_t* p0) {
  if constexpr (Q == Q8_0) {
    return _mm256_xor_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p0 + 2)),
                            _mm256_set1_epi8(char(0x80)));
  } else {
    const __m128i a0 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p0 + (Q == Q4_1 ? 4 : 2)));
    return _mm256_and_si256(_mm256_inserti128_si256(_mm256_castsi128_si256(a0), _mm_srli_epi16(a0, 4), 1),
                            _mm256_set1_epi8(0x0F));
  }
}

// R rows x NB weight rows of accumulators; the weights decoded once a pass for all R rows.
template <int64_t Q, int R, int NB>
__attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni,fma,f16c"))) void q8_avx512(
    const uint8_t* wrow, int64_t row_bytes, int64_t, const Q8Rows& a, int64_t r0, int, float* y, int64_t ldy) {
  constexpr int64_t bb = Q == Q4_1 ? 20 : Q == Q4_0 ? 18 : 34;
  const int64_t g = a.g, k = a.k;
  const int8_t* xq = a.q.data() + r0 * k;
  const float* dv = a.dv.data() + r0 * g * 8;
  const int32_t* corr = a.corr.data() + r0 * g * 8;
  __m512 acc[R][NB];
  __m256 accm[NB];  // lane r: row r0 + r
  for (int c = 0; c < NB; ++c) {
    accm[c] = _mm256_setzero_ps();
    for (int r = 0; r < R; ++r) acc[r][c] = _mm512_setzero_ps();
  }
  int64_t b = 0;
  for (; b + 2 <= g; b += 2) {
    __m512i u[NB];
    __m512 dw[NB];
    for (int c = 0; c < NB; ++c) {
      const uint8_t* p0 = wrow + c * row_bytes + b * bb;
      dw[c] = _mm512_castpd_ps(_mm512_insertf64x4(_mm512_castps_pd(_mm512_set1_ps(_cvtsh_ss(load_u16(p0)))),
                                                 _mm256_castps_pd(_mm256_set1_ps(_cvtsh_ss(load_u16(p0 + bb)))), 1));
      u[c] = unsigned_pair<Q>(p0, p0 + bb);
      if constexpr (Q == Q4_1) {
        accm[c] = _mm256_fmadd_ps(_mm256_set1_ps(_cvtsh_ss(load_u16(p0 + 2))), _mm256_loadu_ps(&a.sx[b * a.ld_sx + r0]), accm[c]);
        accm[c] = _mm256_fmadd_ps(_mm256_set1_ps(_cvtsh_ss(load_u16(p0 + bb + 2))),
                                  _mm256_loadu_ps(&a.sx[(b + 1) * a.ld_sx + r0]), accm[c]);
      }
    }
    for (int r = 0; r < R; ++r) {
      const __m512i xv = _mm512_loadu_si512(xq + r * k + b * kBlock);
      const __m512 dx = _mm512_loadu_ps(dv + (r * g + b) * 8);
      const __m512i ci = Q == Q4_1 ? _mm512_setzero_si512() : _mm512_loadu_si512(corr + (r * g + b) * 8);
      for (int c = 0; c < NB; ++c)
        acc[r][c] = _mm512_fmadd_ps(_mm512_mul_ps(dw[c], dx), _mm512_cvtepi32_ps(_mm512_dpbusd_epi32(ci, u[c], xv)),
                                    acc[r][c]);
    }
  }
  if (b < g) {  // an odd last block: the even lanes only (the others keep their bits, as the scalar path does)
    for (int c = 0; c < NB; ++c) {
      const uint8_t* p0 = wrow + c * row_bytes + b * bb;
      const __m256 dw1 = _mm256_set1_ps(_cvtsh_ss(load_u16(p0)));
      const __m256i u1 = unsigned_one<Q>(p0);
      if constexpr (Q == Q4_1)
        accm[c] = _mm256_fmadd_ps(_mm256_set1_ps(_cvtsh_ss(load_u16(p0 + 2))), _mm256_loadu_ps(&a.sx[b * a.ld_sx + r0]), accm[c]);
      for (int r = 0; r < R; ++r) {
        const __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + r * k + b * kBlock));
        const __m256 dx = _mm256_loadu_ps(dv + (r * g + b) * 8);
        const __m256i ci = Q == Q4_1 ? _mm256_setzero_si256()
                                     : _mm256_loadu_si256(reinterpret_cast<const __m256i*>(corr + (r * g + b) * 8));
        const __m256 f = _mm256_cvtepi32_ps(_mm256_dpbusd_epi32(ci, u1, xv));
        acc[r][c] = _mm512_mask3_fmadd_ps(_mm512_zextps256_ps512(_mm256_mul_ps(dw1, dx)), _mm512_zextps256_ps512(f),
                                          acc[r][c], 0x00FF);
      }
    }
  }
  for (int c = 0; c < NB; ++c) {
    alignas(32) float m[8];
    _mm256_store_ps(m, accm[c]);
    for (int r = 0; r < R; ++r) {
      const __m256 lo = _mm512_castps512_ps256(acc[r][c]);
      const __m256 hi = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(acc[r][c]), 1));
      y[r * ldy + c] = tree_sum(lo, hi) + m[r];
    }
  }
}

template <int64_t Q>
Q8Fn avx512_for(int rows, int nb) {
#define SPECSERVE_Q(R) \
  case R: return nb == 1 ? q8_avx512<Q, R, 1> : nb == 2 ? q8_avx512<Q, R, 2> : q8_avx512<Q, (R > 4 ? 4 : R), 4>;
  switch (rows) { SPECSERVE_Q(1) SPECSERVE_Q(2) SPECSERVE_Q(3) SPECSERVE_Q(4) SPECSERVE_Q(5) SPECSERVE_Q(6)
                  SPECSERVE_Q(7) SPECSERVE_Q(8) }
#undef SPECSERVE_Q
  return nullptr;
}

Q8Fn avx512_kernel(int64_t qtype, int rows, int nb) {
  return qtype == Q4_1 ? avx512_for<Q4_1>(rows, nb) : qtype == Q4_0 ? avx512_for<Q4_0>(rows, nb)
                                                                    : avx512_for<Q8_0>(rows, nb);
}
#endif

// x [M, K] float32, blocks [N, K / 32 * block bytes] uint8 -> y [M, N] float32, x quantized to 8 bits per block.
at::Tensor block_mm_q8(const at::Tensor& x_in, const at::Tensor& blocks, int64_t qtype, int64_t isa) {
  TORCH_CHECK(x_in.dim() == 2 && x_in.scalar_type() == at::kFloat && x_in.device().is_cpu(), "x: [M, K] float32 CPU");
  TORCH_CHECK(blocks.dim() == 2 && blocks.scalar_type() == at::kByte && blocks.is_contiguous(), "blocks: [N, bytes] uint8");
  const at::Tensor x = x_in.contiguous();
  const int64_t m = x.size(0), k = x.size(1), n = blocks.size(0), bb = block_bytes(qtype);
  TORCH_CHECK(k % kBlock == 0 && blocks.size(1) == k / kBlock * bb, "blocks do not hold ", k, " weights a row");
  at::Tensor y = at::empty({m, n}, x.options());
  if (m == 0 || n == 0) return y;
  int64_t chosen = resolve_isa(isa);
  if (chosen == kAvx512) chosen = kAvx2;  // AVX-512 without VNNI: the AVX2 integer path
  const Q8Rows a = quantize_rows(x.data_ptr<float>(), m, k, qtype);
  const uint8_t* wp = blocks.data_ptr<uint8_t>();
  float* yp = y.data_ptr<float>();
  const int64_t row_bytes = blocks.size(1);
  at::parallel_for(0, n, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r0 = 0; r0 < m; r0 += kRowTile) {
      const int rows = int(std::min<int64_t>(kRowTile, m - r0));
      const int widest = rows <= 4 ? 4 : 2;  // weight rows a pass (accumulators: rows x weight rows <= 16)
      for (int64_t j = begin; j < end;) {
        int nb = 1;
        Q8Fn fn = chosen == kSkewed ? q8_scalar<true> : q8_scalar<false>;
#ifdef SPECSERVE_X86
        if (chosen == kAvx512Vnni) {
          nb = end - j >= widest ? widest : end - j >= 2 ? 2 : 1;
          fn = avx512_kernel(qtype, rows, nb);
        } else if (chosen == kAvx2) {
          fn = q8_avx2;
        }
#endif
        fn(wp + j * row_bytes, row_bytes, qtype, a, r0, rows, yp + r0 * n + j, n);
        j += nb;
      }
    }
  });
  return y;
}

// x [M, K] -> (q [M, K] int8, d [M, K / 32] float32): the activations as every path quantizes them (for tests).
std::tuple<at::Tensor, at::Tensor> quantize_q8(const at::Tensor& x_in) {
  const at::Tensor x = x_in.contiguous();
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.size(1) % kBlock == 0, "x: [M, K] float32");
  const Q8Rows a = quantize_rows(x.data_ptr<float>(), x.size(0), x.size(1), Q4_1);
  at::Tensor q = at::empty({a.m, a.k}, x.options().dtype(at::kChar));
  at::Tensor d = at::empty({a.m, a.g}, x.options());
  std::copy(a.q.begin(), a.q.end(), q.data_ptr<int8_t>());
  std::copy(a.d.begin(), a.d.end(), d.data_ptr<float>());
  return {q, d};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(specserve_gguf, m) {
  m.def("mm_q8(Tensor x, Tensor blocks, int qtype, int isa=-1) -> Tensor", &block_mm_q8);
  m.def("quantize_q8(Tensor x) -> (Tensor, Tensor)", &quantize_q8);
}
