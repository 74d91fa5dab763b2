// y[M, N] = q8(x)[M, K] W^T with W from a GGUF file's blocks (Q4_0, Q4_1, Q8_0) and the activations quantized
// per row and per 32-block to 8 bits, as llama.cpp computes these formats (its Q8_0 / Q8_1 activation blocks):
//   d = max|x| / 127 (stored rounded to float16, as llama.cpp stores it), q = round-half-even(x / d) in -127..127,
//   and for Q4_1's min term s = d * sum(q);
// each block's dot product is an exact integer, combined in float32 in one fixed order.
//
// Layout: the weights are repacked once at load (pack_q8) so that 16 output columns share each register: per
// group of 16 columns and block, their 16 float16 scales (and Q4_1's mins), then 4-byte runs of each column
// interleaved (64 bytes: 4 consecutive k of each of 16 columns), so one vpdpbusd against 4 activation bytes
// broadcast adds 4 products into each of 16 columns' integer sums, with no horizontal reduction. That is what
// makes a row cost ~1/3 of the float32 path's FMAs.
//
// Row-invariant by construction, like the float32 path (gguf_blocks.cpp):
//   - a row's quantized activations depend on that row alone (quantize_rows, one scalar function for all paths);
//   - y[m, n] = the sequence over blocks b = 0, 1, ... of acc = fma(dw_b * dx_b, p_b, acc) and then (Q4_1)
//     acc = fma(m_b, s_b, acc), from acc = 0, where p_b is the block's integer dot product, exact in int32 whatever
//     computes it (vpdpbusd on the weights + offset with the offset's sum removed, or a C loop);
//   - threads split the 16-column groups, never K; row tiles only keep accumulators in registers.
// So the AVX-512 VNNI and scalar paths give the same bits, at every M and thread count.
#include "gguf_blocks.h"

#include <ATen/Parallel.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <tuple>
#include <vector>

namespace {
using namespace specserve_gguf;

constexpr int kRowTile = 8;  // rows a pass: 8 accumulators + 8 weight registers of 32
constexpr int kCols = 16;    // output columns a group (the lanes of one 512-bit register)
#ifndef SPECSERVE_Q8_AHEAD
#define SPECSERVE_Q8_AHEAD 1024  // measured: 0 / 1024 / 2048 / 4096 -> 10.1 / 9.1 / 9.3 / 9.1 ms (5 rows)
#endif
// Bytes ahead of the block in use that the AVX-512 path prefetches: rows' compute then overlaps the weight stream.
constexpr int64_t kAhead = SPECSERVE_Q8_AHEAD;

// Bytes of one packed group-block: scales (and mins), then the 16 columns' weights.
int64_t packed_bytes(int64_t qtype) { return qtype == Q4_0 ? 32 + 256 : qtype == Q4_1 ? 64 + 256 : 32 + 512; }
int64_t weights_at(int64_t qtype) { return qtype == Q4_1 ? 64 : 32; }

// A call's activations, quantized; every entry of row r is computed from row r of x alone.
struct Q8Rows {
  int64_t m, k, g;
  std::vector<int8_t> q;       // [M, K] the 8-bit activations
  std::vector<float> d;        // [M, G] their scale per block
  std::vector<int32_t> corr;   // [M, G] -offset * sum(q): removes the weights' unsigned offset (vpdpbusd)
  std::vector<float> sx;       // [M, G] s = d * sum(q) (Q4_1's min term)
};

// The unsigned form the VNNI path reads a weight in is w + offset (vpdpbusd takes unsigned x signed bytes).
int offset_of(int64_t qtype) { return qtype == Q4_0 ? 8 : qtype == Q8_0 ? 128 : 0; }

Q8Rows quantize_rows(const float* x, int64_t m, int64_t k, int64_t qtype) {
  Q8Rows a;
  a.m = m; a.k = k; a.g = k / kBlock;
  a.q.resize(m * k); a.d.resize(m * a.g); a.corr.resize(m * a.g); a.sx.resize(m * a.g);
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
      a.corr[r * a.g + b] = -off * sum;
      a.sx[r * a.g + b] = dh * float(sum);
    }
  return a;
}

// File blocks [N, G * block bytes] -> packed [ceil(N / 16), G, packed bytes] (missing columns: zero blocks).
at::Tensor pack_q8(const at::Tensor& blocks, int64_t qtype) {
  TORCH_CHECK(blocks.dim() == 2 && blocks.scalar_type() == at::kByte && blocks.is_contiguous(), "blocks: [N, bytes] uint8");
  const int64_t n = blocks.size(0), bb = block_bytes(qtype), g = blocks.size(1) / bb, pb = packed_bytes(qtype);
  const int64_t groups = (n + kCols - 1) / kCols;
  at::Tensor out = at::zeros({groups, g, pb}, blocks.options());
  const uint8_t* src = blocks.data_ptr<uint8_t>();
  uint8_t* dst = out.data_ptr<uint8_t>();
  const int64_t wat = weights_at(qtype), nbytes = qtype == Q8_0 ? 32 : 16;  // weight bytes a column-block
  for (int64_t col = 0; col < n; ++col)
    for (int64_t b = 0; b < g; ++b) {
      const uint8_t* blk = src + col * blocks.size(1) + b * bb;
      uint8_t* grp = dst + ((col / kCols) * g + b) * pb;
      const int64_t c = col % kCols;
      std::memcpy(grp + 2 * c, blk, 2);                                     // d
      if (qtype == Q4_1) std::memcpy(grp + 32 + 2 * c, blk + 2, 2);         // m
      const uint8_t* w = blk + (qtype == Q4_1 ? 4 : 2);
      for (int64_t j = 0; j < nbytes; ++j) grp[wat + (j / 4) * 64 + c * 4 + j % 4] = w[j];
    }
  return out;
}

// Column c's 32 weights of one packed group-block as integers (Q4_0: q - 8, Q4_1: q, Q8_0: q), d and (Q4_1) m.
void column_ints(const uint8_t* grp, int64_t qtype, int64_t c, int* w, float* dw, float* mw) {
  *dw = half_to_float(load_u16(grp + 2 * c));
  *mw = qtype == Q4_1 ? half_to_float(load_u16(grp + 32 + 2 * c)) : 0.0f;
  const uint8_t* wp = grp + weights_at(qtype);
  if (qtype == Q8_0) {
    for (int j = 0; j < 32; ++j) w[j] = int8_t(wp[(j / 4) * 64 + c * 4 + j % 4]);
    return;
  }
  const int sub = qtype == Q4_0 ? 8 : 0;
  for (int j = 0; j < 16; ++j) {
    const uint8_t byte = wp[(j / 4) * 64 + c * 4 + j % 4];  // low nibble: weight j, high: weight j + 16
    w[j] = (byte & 0x0F) - sub;
    w[j + 16] = (byte >> 4) - sub;
  }
}

using Q8Fn = void (*)(const uint8_t*, int64_t, const Q8Rows&, int64_t, int, int, float*, int64_t);

// The definition every path reproduces: group ``grp`` (its G packed blocks), rows r0 .. r0 + rows, the first
// ``cols`` of its 16 columns. Skew: the test-only variant that sums the blocks in reverse when M > 1.
template <bool Skew>
void q8_scalar(const uint8_t* grp, int64_t qtype, const Q8Rows& a, int64_t r0, int rows, int cols, float* y,
               int64_t ldy) {
  const int64_t pb = packed_bytes(qtype);
  int w[32];
  float dw, mw;
  for (int r = 0; r < rows; ++r)
    for (int c = 0; c < cols; ++c) {
      const int64_t row = r0 + r;
      float acc = 0.0f;
      for (int64_t i = 0; i < a.g; ++i) {
        const int64_t b = Skew && a.m > 1 ? a.g - 1 - i : i;
        column_ints(grp + b * pb, qtype, c, w, &dw, &mw);
        const int8_t* xq = a.q.data() + row * a.k + b * kBlock;
        int p = 0;
        for (int j = 0; j < 32; ++j) p += w[j] * xq[j];
        acc = std::fma(dw * a.d[row * a.g + b], float(p), acc);
        if (qtype == Q4_1) acc = std::fma(mw, a.sx[row * a.g + b], acc);
      }
      y[r * ldy + c] = acc;
    }
}

#ifdef SPECSERVE_X86
template <int64_t Q, int R>
__attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni,fma,f16c"))) void q8_avx512(
    const uint8_t* grp, int64_t, const Q8Rows& a, int64_t r0, int, int cols, float* y, int64_t ldy) {
  constexpr int64_t pb = Q == Q4_0 ? 32 + 256 : Q == Q4_1 ? 64 + 256 : 32 + 512, wat = Q == Q4_1 ? 64 : 32;
  const int64_t g = a.g, k = a.k;
  const int8_t* xq = a.q.data() + r0 * k;
  __m512 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t b = 0; b < g; ++b, grp += pb) {
    for (int64_t line = 0; line < pb; line += 64)
      _mm_prefetch(reinterpret_cast<const char*>(grp + kAhead + line), _MM_HINT_T0);
    const __m512 dw = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(grp)));  // [16]
    __m512 mw = _mm512_setzero_ps();
    if constexpr (Q == Q4_1) mw = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(grp + 32)));
    __m512i w[8];  // w[j]: weights 4j .. 4j + 3 of each column, unsigned (w + offset)
    if constexpr (Q == Q8_0) {
      for (int j = 0; j < 8; ++j)
        w[j] = _mm512_xor_si512(_mm512_loadu_si512(grp + wat + 64 * j), _mm512_set1_epi8(char(0x80)));
    } else {
      const __m512i low = _mm512_set1_epi8(0x0F);
      for (int j = 0; j < 4; ++j) {
        const __m512i raw = _mm512_loadu_si512(grp + wat + 64 * j);
        w[j] = _mm512_and_si512(raw, low);
        w[j + 4] = _mm512_and_si512(_mm512_srli_epi16(raw, 4), low);
      }
    }
    for (int r = 0; r < R; ++r) {
      const int8_t* xb = xq + r * k + b * kBlock;
      const int64_t at = (r0 + r) * g + b;
      __m512i p = Q == Q4_1 ? _mm512_setzero_si512() : _mm512_set1_epi32(a.corr[at]);
      for (int j = 0; j < 8; ++j) {
        int32_t four;
        std::memcpy(&four, xb + 4 * j, 4);
        p = _mm512_dpbusd_epi32(p, w[j], _mm512_set1_epi32(four));
      }
      acc[r] = _mm512_fmadd_ps(_mm512_mul_ps(dw, _mm512_set1_ps(a.d[at])), _mm512_cvtepi32_ps(p), acc[r]);
      if constexpr (Q == Q4_1) acc[r] = _mm512_fmadd_ps(mw, _mm512_set1_ps(a.sx[at]), acc[r]);
    }
  }
  const __mmask16 keep = __mmask16((1u << cols) - 1);
  for (int r = 0; r < R; ++r) _mm512_mask_storeu_ps(y + r * ldy, keep, acc[r]);
}

template <int64_t Q>
Q8Fn avx512_for(int rows) {
  static const Q8Fn fns[kRowTile] = {q8_avx512<Q, 1>, q8_avx512<Q, 2>, q8_avx512<Q, 3>, q8_avx512<Q, 4>,
                                     q8_avx512<Q, 5>, q8_avx512<Q, 6>, q8_avx512<Q, 7>, q8_avx512<Q, 8>};
  return fns[rows - 1];
}

Q8Fn avx512_kernel(int64_t qtype, int rows) {
  return qtype == Q4_1 ? avx512_for<Q4_1>(rows) : qtype == Q4_0 ? avx512_for<Q4_0>(rows) : avx512_for<Q8_0>(rows);
}
#endif

// x [M, K] float32, packed [ceil(N / 16), K / 32, packed bytes] uint8 -> y [M, N] float32, x quantized per block.
at::Tensor block_mm_q8(const at::Tensor& x_in, const at::Tensor& packed, int64_t qtype, int64_t n, int64_t isa) {
  TORCH_CHECK(x_in.dim() == 2 && x_in.scalar_type() == at::kFloat && x_in.device().is_cpu(), "x: [M, K] float32 CPU");
  TORCH_CHECK(packed.dim() == 3 && packed.scalar_type() == at::kByte && packed.is_contiguous(), "packed: from pack_q8");
  const at::Tensor x = x_in.contiguous();
  const int64_t m = x.size(0), k = x.size(1), groups = packed.size(0);
  TORCH_CHECK(k % kBlock == 0 && packed.size(1) == k / kBlock && packed.size(2) == packed_bytes(qtype) &&
              groups == (n + kCols - 1) / kCols, "packed weights do not hold ", n, " x ", k, " weights");
  at::Tensor y = at::empty({m, n}, x.options());
  if (m == 0 || n == 0) return y;
  const int64_t chosen = resolve_isa(isa);
  TORCH_CHECK(chosen == kScalar || chosen == kAvx512Vnni || chosen == kSkewed,
              "8-bit activations run on AVX-512 VNNI or the scalar path, not instruction set ", chosen);
  const Q8Rows a = quantize_rows(x.data_ptr<float>(), m, k, qtype);
  const uint8_t* wp = packed.data_ptr<uint8_t>();
  float* yp = y.data_ptr<float>();
  const int64_t group_bytes = packed.size(1) * packed.size(2);
  at::parallel_for(0, groups, 4, [&](int64_t begin, int64_t end) {
    for (int64_t gi = begin; gi < end; ++gi)
      for (int64_t r0 = 0; r0 < m; r0 += kRowTile) {
        const int rows = int(std::min<int64_t>(kRowTile, m - r0));
        const int cols = int(std::min<int64_t>(kCols, n - gi * kCols));
        float* out = yp + r0 * n + gi * kCols;
#ifdef SPECSERVE_X86
        if (chosen == kAvx512Vnni) {
          avx512_kernel(qtype, rows)(wp + gi * group_bytes, qtype, a, r0, rows, cols, out, n);
          continue;
        }
#endif
        (chosen == kSkewed ? q8_scalar<true> : q8_scalar<false>)(wp + gi * group_bytes, qtype, a, r0, rows, cols,
                                                                  out, n);
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
  m.def("pack_q8(Tensor blocks, int qtype) -> Tensor", &pack_q8);
  m.def("mm_q8(Tensor x, Tensor packed, int qtype, int n, int isa=-1) -> Tensor", &block_mm_q8);
  m.def("quantize_q8(Tensor x) -> (Tensor, Tensor)", &quantize_q8);
}
