// The small per-layer ops of a Llama decoder layer on GGUF block weights, fused into a few native calls: a layer is
//   front: hidden' = hidden + delta; n = rms_norm(hidden') w; qkv = n Wqkv^T; RoPE on qkv's q and k heads, in place
//   (attention: the caller's, on views of qkv)
//   back:  hidden'' = hidden' + attn Wo^T; n = rms_norm(hidden'') w; gu = n Wgu^T; a = silu(gate) up;
//          delta = a Wdown^T  (the next layer's front adds it)
// so a layer costs Python three calls (front, attention, back) instead of ~40 small torch ops. The matmuls are the
// block kernel's own operators (gguf_blocks.cpp / gguf_q8.cpp), called through torch's dispatcher: same bits as a
// call from Python.
//
// Row-invariant by construction: every op here computes each row from that row alone (and the weights), in an
// order fixed by the row's length, never by the row count, the row's place or the thread count; threads split
// rows only. The one reduction, RMSNorm's sum of squares, runs 16 lanes (lane l: elements l, l + 16, ... in
// increasing order) summed by the fixed tree of lane_sum (gguf_blocks.h). The elementwise arithmetic is written
// out one rounding per operation (-ffp-contract=off, no -ffast-math):
//   - the residual add and RoPE (x cos + roll(x, D / 2) sin_signed, two products and a sum) are torch's exact bits;
//   - RMSNorm is x * (1 / sqrt(sum / K + eps)) * w, torch's formula, but torch sums the squares in its own order,
//     so a norm can differ from F.rms_norm in the last bit;
//   - silu(g) = g / (1 + exp(-g)) with exp by a fixed polynomial (silu_mul_row), where torch uses its own
//     vectorised exp: last-bit differences again.
// isa 99 ("skewed", tests only): RMSNorm sums in reverse when M > 1, a deliberately row-count-dependent variant.
#include "gguf_blocks.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <tuple>
#include <vector>

namespace {
using namespace specserve_gguf;

constexpr int64_t kRowGrain = 4;  // rows per task: these ops are tiny, a thread only pays for a few rows

void check_rows(const at::Tensor& x, const char* what) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.device().is_cpu() && x.stride(1) == 1, what,
              ": [M, K] float32 CPU with unit column stride");
}

// One row: out = x * (1 / sqrt(mean(x^2) + eps)) * w. ``reverse``: the skewed test variant's order.
void rms_row(const float* x, const float* w, int64_t k, float eps, bool reverse, float* out) {
  float lanes[kLanes] = {};
  if (reverse) {
    for (int64_t i = k - 1; i >= 0; --i) lanes[i % kLanes] = lanes[i % kLanes] + x[i] * x[i];
  } else {
    const int64_t whole = k - k % kLanes;
    for (int64_t i = 0; i < whole; i += kLanes)
      for (int l = 0; l < kLanes; ++l) lanes[l] = lanes[l] + x[i + l] * x[i + l];
    for (int64_t i = whole; i < k; ++i) lanes[i % kLanes] = lanes[i % kLanes] + x[i] * x[i];
  }
  const float mean = lane_sum(lanes) / float(k);
  const float inv = 1.0f / std::sqrt(mean + eps);
  for (int64_t i = 0; i < k; ++i) out[i] = x[i] * inv * w[i];
}

// hidden [M, K] (+ delta [M, K]) -> (sum [M, K], rms_norm(sum) w [M, K]); without delta, sum is hidden itself.
std::tuple<at::Tensor, at::Tensor> add_rms_norm(const at::Tensor& hidden_in, const c10::optional<at::Tensor>& delta_in,
                                                const at::Tensor& weight_in, double eps, int64_t isa) {
  const at::Tensor hidden = hidden_in.contiguous(), weight = weight_in.contiguous();
  check_rows(hidden, "hidden");
  const int64_t m = hidden.size(0), k = hidden.size(1);
  TORCH_CHECK(weight.dim() == 1 && weight.size(0) == k && weight.scalar_type() == at::kFloat, "weight: [K] float32");
  at::Tensor sum = hidden, delta;
  if (delta_in.has_value()) {
    delta = delta_in->contiguous();
    TORCH_CHECK(delta.sizes() == hidden.sizes() && delta.scalar_type() == at::kFloat, "delta: like hidden");
    sum = at::empty_like(hidden);
  }
  at::Tensor out = at::empty_like(hidden);
  const float* hp = hidden.data_ptr<float>();
  const float* dp = delta.defined() ? delta.data_ptr<float>() : nullptr;
  float* sp = sum.data_ptr<float>();
  const float* wp = weight.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const bool reverse = isa == kSkewed && m > 1;
  at::parallel_for(0, m, kRowGrain, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      if (dp != nullptr)
        for (int64_t i = 0; i < k; ++i) sp[r * k + i] = hp[r * k + i] + dp[r * k + i];
      rms_row(sp + r * k, wp, k, float(eps), reverse, op + r * k);
    }
  });
  return {sum, out};
}

// x [M, >= heads * D] (rows may be strided, e.g. qkv's q and k columns): heads 0 .. heads - 1 of each row rotated
// in place by cos, signed sin [M, D] (workers/layers.py RotaryEmbedding): x cos + roll(x, D / 2) sin.
void rope_(at::Tensor& x, const at::Tensor& cos_in, const at::Tensor& sin_in, int64_t heads, int64_t head_dim) {
  check_rows(x, "x");
  const at::Tensor cs = cos_in.reshape({cos_in.size(0), -1}).contiguous();
  const at::Tensor sn = sin_in.reshape({sin_in.size(0), -1}).contiguous();
  const int64_t m = x.size(0), d = head_dim, shift = d / 2, ld = x.stride(0);
  TORCH_CHECK(x.size(1) >= heads * d && cs.size(0) == m && cs.size(1) == d && sn.sizes() == cs.sizes() &&
              cs.scalar_type() == at::kFloat && sn.scalar_type() == at::kFloat, "rope: x [M, heads * D], cos/sin [M, D]");
  float* xp = x.data_ptr<float>();
  const float* cp = cs.data_ptr<float>();
  const float* sp = sn.data_ptr<float>();
  at::parallel_for(0, m, kRowGrain, [&](int64_t begin, int64_t end) {
    std::vector<float> head(d);
    for (int64_t r = begin; r < end; ++r)
      for (int64_t h = 0; h < heads; ++h) {
        float* v = xp + r * ld + h * d;
        std::copy(v, v + d, head.begin());
        for (int64_t i = 0; i < d; ++i) {
          const float a = head[i] * cp[r * d + i], b = head[(i - shift + d) % d] * sp[r * d + i];
          v[i] = a + b;
        }
      }
  });
}

// silu(g) * u = g / (1 + exp(-g)) * u over one row, exp by Cephes' expf: range reduction by n = round(x log2 e)
// (the 1.5 * 2^23 trick: round-half-even, branch-free), a degree-5 polynomial, 2^n from its exponent bits; the
// argument clamped to [-87, 80] (exp(-g) beyond 80 only changes a result that is ~0). Only IEEE basic operations, so
// the compiler's SIMD clones (chosen once per process) compute the bits of the plain loop.
__attribute__((target_clones("avx512f", "avx2", "default"))) void silu_mul_row(const float* g, const float* u,
                                                                                float* out, int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    const float x = std::min(80.0f, std::max(-87.0f, -g[i]));
    const float fx = (x * 1.44269504088896341f + 12582912.0f) - 12582912.0f;  // round(x log2 e)
    float r = x - fx * 0.693359375f;
    r = r - fx * -2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * (r * r) + r + 1.0f;
    const int32_t bits = (int32_t(fx) + 127) << 23;
    float scale;
    std::memcpy(&scale, &bits, 4);
    out[i] = g[i] / (1.0f + p * scale) * u[i];
  }
}

// [M, 2I] (gate | up) -> silu(gate) * up [M, I].
at::Tensor silu_mul(const at::Tensor& x_in) {
  const at::Tensor x = x_in.contiguous();
  check_rows(x, "x");
  const int64_t m = x.size(0), i2 = x.size(1), n = i2 / 2;
  TORCH_CHECK(i2 % 2 == 0, "x: [M, 2I]");
  at::Tensor out = at::empty({m, n}, x.options());
  const float* xp = x.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, m, kRowGrain, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) silu_mul_row(xp + r * i2, xp + r * i2 + n, op + r * n, n);
  });
  return out;
}

// x [M, K] @ W^T through the block kernel's operator: "mm" (float32 activations, file blocks) when n < 0, else
// "mm_q8" (8-bit activations, packed blocks, n output columns).
at::Tensor block_mm(const at::Tensor& x, const at::Tensor& w, int64_t qtype, int64_t n, int64_t isa) {
  if (n < 0) {
    static auto op = c10::Dispatcher::singleton().findSchemaOrThrow("specserve_gguf::mm", "")
                         .typed<at::Tensor(const at::Tensor&, const at::Tensor&, int64_t, int64_t)>();
    return op.call(x, w, qtype, isa);
  }
  static auto op = c10::Dispatcher::singleton().findSchemaOrThrow("specserve_gguf::mm_q8", "")
                       .typed<at::Tensor(const at::Tensor&, const at::Tensor&, int64_t, int64_t, int64_t)>();
  return op.call(x, w, qtype, n, isa);
}

// The attention's input half of a layer: (hidden + delta, qkv with q and k rotated) [M, K], [M, (Hq + 2 Hkv) D].
std::tuple<at::Tensor, at::Tensor> layer_front(const at::Tensor& hidden, const c10::optional<at::Tensor>& delta,
                                               const at::Tensor& norm_w, double eps, const at::Tensor& qkv_w,
                                               int64_t qtype, int64_t n, int64_t mm_isa, const at::Tensor& cos,
                                               const at::Tensor& sin, int64_t rot_heads, int64_t head_dim,
                                               int64_t isa) {
  auto [sum, normed] = add_rms_norm(hidden, delta, norm_w, eps, isa);
  at::Tensor qkv = block_mm(normed, qkv_w, qtype, n, mm_isa);
  rope_(qkv, cos, sin, rot_heads, head_dim);
  return {sum, qkv};
}

// The rest of a layer from the attention's output attn [M, Hq D]: (hidden + attn Wo^T, the MLP's output) [M, K] x 2.
std::tuple<at::Tensor, at::Tensor> layer_back(const at::Tensor& hidden, const at::Tensor& attn, const at::Tensor& o_w,
                                              int64_t o_qtype, int64_t o_n, const at::Tensor& norm_w, double eps,
                                              const at::Tensor& gu_w, int64_t gu_qtype, int64_t gu_n,
                                              const at::Tensor& down_w, int64_t down_qtype, int64_t down_n,
                                              int64_t mm_isa, int64_t isa) {
  const at::Tensor o = block_mm(attn.contiguous(), o_w, o_qtype, o_n, mm_isa);
  auto [sum, normed] = add_rms_norm(hidden, o, norm_w, eps, isa);
  const at::Tensor act = silu_mul(block_mm(normed, gu_w, gu_qtype, gu_n, mm_isa));
  return {sum, block_mm(act, down_w, down_qtype, down_n, mm_isa)};
}

at::Tensor rope_op(at::Tensor x, const at::Tensor& cos, const at::Tensor& sin, int64_t heads, int64_t head_dim) {
  rope_(x, cos, sin, heads, head_dim);
  return x;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(specserve_gguf, m) {
  m.def("add_rms_norm(Tensor hidden, Tensor? delta, Tensor weight, float eps, int isa=0) -> (Tensor, Tensor)",
        &add_rms_norm);
  m.def("rope_(Tensor(a!) x, Tensor cos, Tensor sin, int heads, int head_dim) -> Tensor(a!)", &rope_op);
  m.def("silu_mul(Tensor x) -> Tensor", &silu_mul);
  m.def("layer_front(Tensor hidden, Tensor? delta, Tensor norm_w, float eps, Tensor qkv_w, int qtype, int n, "
        "int mm_isa, Tensor cos, Tensor sin, int rot_heads, int head_dim, int isa=0) -> (Tensor, Tensor)",
        &layer_front);
  m.def("layer_back(Tensor hidden, Tensor attn, Tensor o_w, int o_qtype, int o_n, Tensor norm_w, float eps, "
        "Tensor gu_w, int gu_qtype, int gu_n, Tensor down_w, int down_qtype, int down_n, int mm_isa, int isa=0) "
        "-> (Tensor, Tensor)", &layer_back);
}
