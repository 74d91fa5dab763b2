// Attention for every query row of a forward in one call, each (row, head) computed alone in one fixed order:
// row-invariant by construction (workers/kernels/row_attention.py is the Python side).
//
// out[t, h] = sum_j softmax_j(scale * q[t, h] . k_j) v_j over exactly the keys row t may see, in position order,
// read straight from the paged cache by slot. Row t's keys: positions [0, prefix) of its sequence, then
// ``extra`` positions (a tree node's ancestors and itself, increasing); position p lives at slot
// table[p / block_size] * block_size + p % block_size. GQA: query head h reads kv head h / (Hq / Hkv).
//
// The order of every sum depends only on the row's own key count n and the head size D, never on how many rows
// the call has, their neighbours or the thread count:
//   - threads split (row, kv head) tasks (at::parallel_for, torch's own OpenMP team), never a row's keys;
//   - score s_j = (16 lanes over d: lane l sums d = l, l + 16, ... by fused multiply-adds in increasing d,
//     from +0; then the fixed lane tree of gguf_blocks.h) * scale;
//   - m = max_j s_j (exact); e_j = exp_fixed(s_j - m) (elementwise, the same operations on every path);
//   - l = 16 lanes over keys (lane i sums e_j for j = i, i + 16, ... in increasing j, from +0), the lane tree;
//   - o[d] = fused multiply-adds e_j v_j[d] in increasing j from +0; out[d] = o[d] / l.
// The AVX-512 path computes exactly that (a missing d or j is a zero loaded under a mask, which the scalar path
// adds as a zero too), so both give the same bits (the self-check compares them). Built without -ffast-math and
// with -ffp-contract=off (gguf_blocks.py): the compiler fuses and reorders nothing on its own.
#include "gguf_blocks.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

namespace {
using namespace specserve_gguf;

constexpr int64_t kRowFields = 4;  // rows[t] = (table offset, prefix, extras offset, extras count) into index
constexpr int kMaxVectors = 8;     // AVX-512 path: D <= 128 (8 vectors of 16); larger heads take the scalar path
constexpr float kExpFloor = -87.0f;  // exp_fixed(x) = 0 below: keeps 2^n a normal float (n >= -126)

// e^x for x <= 0 by fixed operations (Cephes' expf: x = n ln2 + r, a degree-7 polynomial in r): every path runs
// these same IEEE operations, so scalar and vector results are bit-identical (~1 ulp from e^x).
inline float exp_fixed(float x) {
  if (x < kExpFloor) return 0.0f;
  const float n = std::nearbyint(x * 1.44269504088896341f);
  float r = std::fma(n, -0.693359375f, x);
  r = std::fma(n, 2.12194440e-4f, r);
  float p = 1.9875691500e-4f;
  p = std::fma(p, r, 1.3981999507e-3f);
  p = std::fma(p, r, 8.3334519073e-3f);
  p = std::fma(p, r, 4.1665795894e-2f);
  p = std::fma(p, r, 1.6666665459e-1f);
  p = std::fma(p, r, 5.0000001201e-1f);
  const float y = std::fma(p, r * r, r) + 1.0f;
  const int32_t bits = (int32_t(n) + 127) << 23;
  float two_n;
  std::memcpy(&two_n, &bits, 4);
  return y * two_n;
}

// One task's view of its row: the slots of its n keys (position order).
struct RowKeys {
  const int64_t* rows;
  const int64_t* index;
  int64_t index_size, block_size, num_slots;

  int64_t gather(int64_t t, std::vector<int64_t>& slots) const {
    const int64_t* r = rows + t * kRowFields;
    const int64_t prefix = r[1], extras = r[3];
    TORCH_CHECK(r[0] >= 0 && prefix >= 0 && extras >= 0 && r[2] >= 0 && r[2] + extras <= index_size,
                "row ", t, ": its layout points outside index");
    const int64_t* table = index + r[0];
    slots.resize(prefix + extras);
    auto slot = [&](int64_t pos) {
      TORCH_CHECK(pos >= 0 && r[0] + pos / block_size < index_size, "row ", t, ": position ", pos, " past its table");
      const int64_t s = table[pos / block_size] * block_size + pos % block_size;
      TORCH_CHECK(s >= 0 && s < num_slots, "key slot ", s, " out of the cache's ", num_slots);
      return s;
    };
    for (int64_t j = 0; j < prefix; ++j) slots[j] = slot(j);
    for (int64_t e = 0; e < extras; ++e) slots[prefix + e] = slot(index[r[2] + e]);
    const int64_t n = prefix + extras;
    slots.resize((n + kLanes - 1) / kLanes * kLanes, n > 0 ? slots[0] : 0);  // whole 16-key blocks (ignored)
    return n;
  }
};

// --- scalar: the definition of the order ---
// q [D] . key [D] as 16 lanes over d then the lane tree.
float dot_scalar(const float* q, const float* key, int64_t d) {
  float acc[kLanes] = {};
  for (int64_t c = 0; c < d; c += kLanes)
    for (int l = 0; l < kLanes; ++l) {
      const bool in = c + l < d;
      acc[l] = std::fma(in ? q[c + l] : 0.0f, in ? key[c + l] : 0.0f, acc[l]);
    }
  return lane_sum(acc);
}

// One (row, query head): q [D], keys/values at slots (stride ``ld`` floats per slot, offset to the kv head
// already applied) -> out [D]. ``s`` is scratch of n floats. ``skewed``: the test-only variant (below).
void head_scalar(const float* q, const float* k, const float* v, int64_t ld, const int64_t* slots, int64_t n,
                 int64_t d, float scale, float* s, float* out, bool skewed) {
  float m = -INFINITY;
  for (int64_t j = 0; j < n; ++j) {
    s[j] = dot_scalar(q, k + slots[j] * ld, d) * scale;
    m = s[j] > m ? s[j] : m;
  }
  for (int64_t j = 0; j < n; ++j) s[j] = exp_fixed(s[j] - m);
  float l;
  if (skewed) {  // one running sum in key order: another order than the lanes' (only when the call has rows > 1)
    l = 0.0f;
    for (int64_t j = 0; j < n; ++j) l += s[j];
  } else {
    float lanes[kLanes] = {};
    for (int64_t c = 0; c < n; c += kLanes)
      for (int i = 0; i < kLanes; ++i) lanes[i] = lanes[i] + (c + i < n ? s[c + i] : 0.0f);
    l = lane_sum(lanes);
  }
  for (int64_t x = 0; x < d; ++x) out[x] = 0.0f;
  for (int64_t j = 0; j < n; ++j) {
    const float* vj = v + slots[j] * ld;
    for (int64_t x = 0; x < d; ++x) out[x] = std::fma(s[j], vj[x], out[x]);
  }
  for (int64_t x = 0; x < d; ++x) out[x] = out[x] / l;
}

#ifdef SPECSERVE_X86
__attribute__((target("avx512f"))) inline float tree16(__m512 acc) {
  const __m256 lo = _mm512_castps512_ps256(acc);
  const __m256 hi = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(acc), 1));
  return tree_sum(lo, hi);
}

// exp_fixed on 16 lanes: the same operations.
__attribute__((target("avx512f"))) inline __m512 exp16(__m512 x) {
  const __mmask16 live = _mm512_cmp_ps_mask(x, _mm512_set1_ps(kExpFloor), _CMP_GE_OQ);
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fmadd_ps(n, _mm512_set1_ps(-0.693359375f), x);
  r = _mm512_fmadd_ps(n, _mm512_set1_ps(2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  const __m512 y = _mm512_add_ps(_mm512_fmadd_ps(p, _mm512_mul_ps(r, r), r), _mm512_set1_ps(1.0f));
  const __m512i bits = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
  return _mm512_maskz_mul_ps(live, y, _mm512_castsi512_ps(bits));
}

// The lane trees of 16 keys' accumulators at once: out[i] = the tree of acc[i] (lanes l + 8, then + 4, + 2, + 1,
// the pairs of lane_sum; a + b == b + a exactly, so which operand comes first does not matter), by transposing
// shuffles instead of 16 separate trees.
__attribute__((target("avx512f"))) inline __m512 trees16(const __m512 (&acc)[kLanes]) {
  __m512 a8[8], a4[4], a2[2];
#pragma GCC unroll 8
  for (int i = 0; i < 8; ++i)  // [key 2i: t_l + t_l+8, l < 8 | key 2i + 1: the same]
    a8[i] = _mm512_add_ps(_mm512_shuffle_f32x4(acc[2 * i], acc[2 * i + 1], 0x44),
                          _mm512_shuffle_f32x4(acc[2 * i], acc[2 * i + 1], 0xEE));
#pragma GCC unroll 4
  for (int i = 0; i < 4; ++i)  // 128-bit chunk c: key 4i + c, t_l + t_l+4, l < 4
    a4[i] = _mm512_add_ps(_mm512_shuffle_f32x4(a8[2 * i], a8[2 * i + 1], 0x88),
                          _mm512_shuffle_f32x4(a8[2 * i], a8[2 * i + 1], 0xDD));
#pragma GCC unroll 2
  for (int i = 0; i < 2; ++i)  // chunk c: [key 8i + c: t_0 + t_2, t_1 + t_3 | key 8i + 4 + c: the same]
    a2[i] = _mm512_add_ps(_mm512_shuffle_ps(a4[2 * i], a4[2 * i + 1], 0x44),
                          _mm512_shuffle_ps(a4[2 * i], a4[2 * i + 1], 0xEE));
  // chunk c: keys c, 4 + c, 8 + c, 12 + c; then into key order
  const __m512 r = _mm512_add_ps(_mm512_shuffle_ps(a2[0], a2[1], 0x88), _mm512_shuffle_ps(a2[0], a2[1], 0xDD));
  const __m512i order = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
  return _mm512_permutexvar_ps(order, r);
}

// Scores of g heads (q + h qs) against all n keys: s[h es + j] = tree(16 lanes over d) * scale, 16 keys at a time,
// every head of a block before the next block (its keys, read once from L2, serve the other heads from L1).
template <int NV>
__attribute__((target("avx512f"))) void scores_avx512(const float* q, int64_t qs, int64_t g, const float* k,
                                                      int64_t ld, const int64_t* slots, int64_t n, int64_t d,
                                                      float scale, float* s, int64_t es) {
  const __mmask16 tail = d % kLanes == 0 ? __mmask16(0xFFFF) : __mmask16((1u << (d % kLanes)) - 1);
  const __m512 sc = _mm512_set1_ps(scale);
  for (int64_t j0 = 0; j0 < n; j0 += kLanes) {  // slots holds whole blocks: keys past n are computed, not kept
    const int64_t keys = std::min<int64_t>(kLanes, n - j0);
    const __mmask16 live = keys == kLanes ? __mmask16(0xFFFF) : __mmask16((1u << keys) - 1);
    for (int64_t h = 0; h < g; ++h) {
      __m512 qv[NV];
#pragma GCC unroll 8
      for (int c = 0; c < NV; ++c) qv[c] = _mm512_maskz_loadu_ps(c == NV - 1 ? tail : 0xFFFF, q + h * qs + c * kLanes);
      __m512 acc[kLanes];
#pragma GCC unroll 16
      for (int i = 0; i < kLanes; ++i) {
        const float* kj = k + slots[j0 + i] * ld;
        acc[i] = _mm512_setzero_ps();
#pragma GCC unroll 8
        for (int c = 0; c < NV; ++c)
          acc[i] = _mm512_fmadd_ps(qv[c], _mm512_maskz_loadu_ps(c == NV - 1 ? tail : 0xFFFF, kj + c * kLanes),
                                   acc[i]);
      }
      _mm512_mask_storeu_ps(s + h * es + j0, live, _mm512_mul_ps(trees16(acc), sc));
    }
  }
}

// s[0, n) -> exp_fixed(s - max) in place; returns their sum (16 lanes over keys, the lane tree).
__attribute__((target("avx512f"))) float softmax_avx512(float* s, int64_t n) {
  __m512 mv = _mm512_set1_ps(-INFINITY);
  float m = -INFINITY;
  int64_t j = 0;
  for (; j + kLanes <= n; j += kLanes) mv = _mm512_max_ps(mv, _mm512_loadu_ps(s + j));
  for (; j < n; ++j) m = s[j] > m ? s[j] : m;
  m = std::max(m, _mm512_reduce_max_ps(mv));  // max is exact: any order gives the same value
  const __m512 mb = _mm512_set1_ps(m);
  __m512 lanes = _mm512_setzero_ps();
  for (j = 0; j < n; j += kLanes) {
    const __mmask16 live = n - j >= kLanes ? __mmask16(0xFFFF) : __mmask16((1u << (n - j)) - 1);
    const __m512 e = _mm512_maskz_mov_ps(live, exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(live, s + j), mb)));
    _mm512_mask_storeu_ps(s + j, live, e);
    lanes = _mm512_add_ps(lanes, e);
  }
  return tree16(lanes);
}

// HB heads' weighted value sums at once (each its own accumulators, keys in increasing order): out[h] = o / l[h].
template <int NV, int HB>
__attribute__((target("avx512f"))) void values_avx512(const float* e, int64_t es, const float* v, int64_t ld,
                                                      const int64_t* slots, int64_t n, int64_t d, const float* l,
                                                      float* out) {
  const __mmask16 tail = d % kLanes == 0 ? __mmask16(0xFFFF) : __mmask16((1u << (d % kLanes)) - 1);
  __m512 o[HB * NV];
#pragma GCC unroll 32
  for (int x = 0; x < HB * NV; ++x) o[x] = _mm512_setzero_ps();
  for (int64_t j = 0; j < n; ++j) {
    const float* vj = v + slots[j] * ld;
    __m512 vv[NV];
#pragma GCC unroll 8
    for (int c = 0; c < NV; ++c) vv[c] = _mm512_maskz_loadu_ps(c == NV - 1 ? tail : 0xFFFF, vj + c * kLanes);
#pragma GCC unroll 4
    for (int h = 0; h < HB; ++h) {
      const __m512 w = _mm512_set1_ps(e[h * es + j]);
#pragma GCC unroll 8
      for (int c = 0; c < NV; ++c) o[h * NV + c] = _mm512_fmadd_ps(w, vv[c], o[h * NV + c]);
    }
  }
#pragma GCC unroll 4
  for (int h = 0; h < HB; ++h) {
    const __m512 lv = _mm512_set1_ps(l[h]);
#pragma GCC unroll 8
    for (int c = 0; c < NV; ++c)
      _mm512_mask_storeu_ps(out + h * d + c * kLanes, c == NV - 1 ? tail : 0xFFFF, _mm512_div_ps(o[h * NV + c], lv));
  }
}

constexpr int kMaxHeads = 4;  // heads a value pass carries (HB x NV accumulators + NV values in 32 registers)
using ScoresFn = void (*)(const float*, int64_t, int64_t, const float*, int64_t, const int64_t*, int64_t, int64_t,
                          float, float*, int64_t);
using ValuesFn = void (*)(const float*, int64_t, const float*, int64_t, const int64_t*, int64_t, int64_t,
                          const float*, float*);
#define SPECSERVE_NV(fn, ...) {fn<1, ##__VA_ARGS__>, fn<2, ##__VA_ARGS__>, fn<3, ##__VA_ARGS__>, \
    fn<4, ##__VA_ARGS__>, fn<5, ##__VA_ARGS__>, fn<6, ##__VA_ARGS__>, fn<7, ##__VA_ARGS__>, fn<8, ##__VA_ARGS__>}

// One (row, kv head) task: the G query heads q[h] (stride qs) that read it -> out[h] (stride d).
void task_avx512(const float* q, int64_t qs, int64_t g, const float* k, const float* v, int64_t ld,
                 const int64_t* slots, int64_t n, int64_t d, float scale, std::vector<float>& s, float* out) {
  static const ScoresFn scores[kMaxVectors] = SPECSERVE_NV(scores_avx512);
  static const ValuesFn values[kMaxHeads][kMaxVectors] = {SPECSERVE_NV(values_avx512, 1),
                                                          SPECSERVE_NV(values_avx512, 2),
                                                          SPECSERVE_NV(values_avx512, 3),
                                                          SPECSERVE_NV(values_avx512, 4)};
  const int64_t nv = (d + kLanes - 1) / kLanes, es = (n + kLanes - 1) / kLanes * kLanes;
  s.resize(g * es);
  float l[64];
  scores[nv - 1](q, qs, g, k, ld, slots, n, d, scale, s.data(), es);
  for (int64_t h = 0; h < g; ++h) l[h] = softmax_avx512(s.data() + h * es, n);
  const int64_t hb = std::max<int64_t>(1, std::min<int64_t>(kMaxHeads, 16 / nv));
  for (int64_t h = 0; h < g; h += hb) {
    const int64_t heads = std::min(hb, g - h);
    values[heads - 1][nv - 1](s.data() + h * es, es, v, ld, slots, n, d, l + h, out + h * d);
  }
}
#endif

// q [T, Hq, D] float32 (D contiguous), k / v [S, Hkv, D] float32 (one layer of the paged cache), rows [T, 4]
// int64, index [*] int64 (rows' block tables and extra positions) -> out [T, Hq, D] float32.
at::Tensor row_attention(const at::Tensor& q_in, const at::Tensor& k, const at::Tensor& v, const at::Tensor& rows,
                         const at::Tensor& index, int64_t block_size, double scale, int64_t isa) {
  TORCH_CHECK(q_in.dim() == 3 && q_in.scalar_type() == at::kFloat && q_in.device().is_cpu(), "q: [T, Hq, D] float32 CPU");
  TORCH_CHECK(k.dim() == 3 && k.scalar_type() == at::kFloat && k.is_contiguous() && v.sizes() == k.sizes() &&
              v.scalar_type() == at::kFloat && v.is_contiguous(), "k, v: [slots, Hkv, D] float32, contiguous");
  TORCH_CHECK(rows.dim() == 2 && rows.size(1) == kRowFields && rows.scalar_type() == at::kLong && rows.is_contiguous() &&
              index.dim() == 1 && index.scalar_type() == at::kLong && index.is_contiguous(),
              "rows: [T, 4] int64, index: [*] int64, contiguous");
  const at::Tensor q = q_in.stride(2) == 1 ? q_in : q_in.contiguous();
  const int64_t t = q.size(0), hq = q.size(1), d = q.size(2), hkv = k.size(1);
  TORCH_CHECK(rows.size(0) == t && k.size(2) == d && hkv > 0 && hq % hkv == 0 && block_size > 0,
              "shapes: rows ", rows.size(0), " for ", t, " queries, head size ", k.size(2), " vs ", d,
              ", ", hq, " query heads on ", hkv, " kv heads");
  at::Tensor out = at::empty({t, hq, d}, q.options().memory_format(at::MemoryFormat::Contiguous));
  if (t == 0) return out;
  const int64_t chosen = resolve_isa(isa);
  const bool skewed = chosen == kSkewed && t > 1;
  const bool fast = chosen >= kAvx512 && chosen != kSkewed && d <= kMaxVectors * kLanes && hq / hkv <= 64;
  const int64_t group = hq / hkv, ld = hkv * d;
  const RowKeys keys{rows.data_ptr<int64_t>(), index.data_ptr<int64_t>(), index.numel(), block_size, k.size(0)};
  const float* qp = q.data_ptr<float>();
  const float* kp = k.data_ptr<float>();
  const float* vp = v.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t qs0 = q.stride(0), qs1 = q.stride(1);
  const float sc = float(scale);
  int64_t work = 0;  // key-heads of the whole call: small calls stay on this thread
  for (int64_t i = 0; i < t; ++i) work += rows.data_ptr<int64_t>()[i * kRowFields + 1] + rows.data_ptr<int64_t>()[i * kRowFields + 3];
  const int64_t grain = work * hq * d < (1 << 16) ? t * hkv : 1;
  at::parallel_for(0, t * hkv, grain, [&](int64_t begin, int64_t end) {
    std::vector<int64_t> slots;
    std::vector<float> s;
    for (int64_t task = begin; task < end; ++task) {
      const int64_t i = task / hkv, g = task % hkv;
      const int64_t n = keys.gather(i, slots);
      TORCH_CHECK(n > 0, "query row ", i, " sees no keys");
#ifdef SPECSERVE_X86
      if (fast) {
        task_avx512(qp + i * qs0 + g * group * qs1, qs1, group, kp + g * d, vp + g * d, ld, slots.data(), n, d, sc,
                    s, op + (i * hq + g * group) * d);
        continue;
      }
#endif
      s.resize(n);
      for (int64_t h = g * group; h < (g + 1) * group; ++h)
        head_scalar(qp + i * qs0 + h * qs1, kp + g * d, vp + g * d, ld, slots.data(), n, d, sc, s.data(),
                    op + (i * hq + h) * d, skewed);
    }
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(specserve_gguf, m) {
  m.def("row_attention(Tensor q, Tensor k, Tensor v, Tensor rows, Tensor index, int block_size, float scale, "
        "int isa=-1) -> Tensor", &row_attention);
}
