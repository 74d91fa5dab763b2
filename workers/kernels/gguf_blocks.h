// What both halves of the GGUF block kernel share (gguf_blocks.cpp: float32 activations; gguf_q8.cpp: 8-bit
// activations): the block formats, the instruction-set choice, and the fixed lane tree every output is summed by.
#pragma once
#include <ATen/ATen.h>

#include <cstdint>
#include <cstring>

#if defined(__x86_64__)
#include <immintrin.h>
#define SPECSERVE_X86 1
#endif

namespace specserve_gguf {

constexpr int64_t kBlock = 32;   // weights per block (all three formats)
constexpr int kLanes = 16;       // accumulator lanes per row (the reduction order's shape)
enum QType : int64_t { Q4_0 = 2, Q4_1 = 3, Q8_0 = 8 };  // ggml's type ids
// kSkewed: a deliberately row-count-dependent variant (lanes summed in another order when M > 1), only for
// showing that the row-invariance tests catch such a kernel (tests/test_kernel_gguf.py).
// kAvx512Vnni: AVX-512 with vpdpbusd (the integer-activation path, gguf_q8.cpp); the float32 path runs its
// AVX-512 code there.
enum Isa : int64_t { kAuto = -1, kScalar = 0, kAvx2 = 1, kAvx512 = 2, kAvx512Vnni = 3, kSkewed = 99 };

inline int64_t block_bytes(int64_t qtype) {
  switch (qtype) {
    case Q4_0: return 18;  // d, 16 bytes of nibbles
    case Q4_1: return 20;  // d, m, 16 bytes of nibbles
    case Q8_0: return 34;  // d, 32 int8
    default: TORCH_CHECK(false, "unsupported GGUF block type ", qtype);
  }
}

inline float half_to_float(uint16_t h) {  // exact IEEE binary16 -> binary32 (subnormals included)
  uint32_t sign = uint32_t(h & 0x8000) << 16, exp = (h >> 10) & 0x1F, mant = h & 0x3FF, bits;
  if (exp == 0x1F) {
    bits = sign | 0x7F800000u | (mant << 13);
  } else if (exp != 0) {
    bits = sign | ((exp + 112) << 23) | (mant << 13);
  } else if (mant == 0) {
    bits = sign;
  } else {  // subnormal: normalise
    exp = 113;
    while (!(mant & 0x400)) { mant <<= 1; --exp; }
    bits = sign | (exp << 23) | ((mant & 0x3FF) << 13);
  }
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

inline uint16_t load_u16(const uint8_t* p) { uint16_t v; std::memcpy(&v, p, 2); return v; }

inline float lane_sum(float* t) {  // the fixed horizontal sum: halves added 8, 4, 2, 1 lanes apart
  for (int s = kLanes / 2; s >= 1; s /= 2)
    for (int l = 0; l < s; ++l) t[l] = t[l] + t[l + s];
  return t[0];
}

#ifdef SPECSERVE_X86
// The fixed lane tree of lane_sum, in registers: the same additions on the same pairs (a + b == b + a exactly).
inline __attribute__((target("avx2"))) float tree_sum(__m256 lo, __m256 hi) {
  const __m256 s8 = _mm256_add_ps(lo, hi);                                                     // l, l + 8
  const __m128 s4 = _mm_add_ps(_mm256_castps256_ps128(s8), _mm256_extractf128_ps(s8, 1));      // l, l + 4
  const __m128 s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));                                      // l, l + 2
  return _mm_cvtss_f32(_mm_add_ss(s2, _mm_shuffle_ps(s2, s2, 1)));                              // 0, 1
}

#endif

inline int64_t best_isa() {
#ifdef SPECSERVE_X86
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx512f"))
    return __builtin_cpu_supports("avx512vnni") && __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl") ? kAvx512Vnni : kAvx512;
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) return kAvx2;
#endif
  return kScalar;
}

inline int64_t resolve_isa(int64_t isa) {
  const int64_t best = best_isa();
  if (isa == kAuto) return best;
  if (isa == kSkewed) return isa;
  TORCH_CHECK(isa >= kScalar && isa <= best, "instruction set ", isa, " not available here (best: ", best, ")");
  return isa;
}

}  // namespace specserve_gguf
