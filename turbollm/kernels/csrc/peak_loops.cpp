// Instruction-rate ceilings for `turbollm bench kernels`: register-only loops of independent
// multiply-adds (no memory traffic), one per instruction form, each compiled for its own target by a
// function attribute. A vector loop of n iterations runs 12 chains x n instructions, the AMX loop 4
// tile products x n; ops = 2 x the MACs.
#include <cstdint>
#include <cstring>
#include <immintrin.h>

#include "peak_loops.h"

namespace tq {
bool amx_ready();  // qmm_amx.cpp
}

namespace tq {
namespace peak {
namespace {
constexpr int kChains = 12;
}

#define TQ_PEAK_LOOP(acc_t, zero, step, sum)                              \
  acc_t a[kChains];                                                       \
  for (int i = 0; i < kChains; ++i) a[i] = zero;                          \
  for (int64_t it = 0; it < n; ++it) {                                    \
    _Pragma("GCC unroll 12") for (int i = 0; i < kChains; ++i) a[i] = step; \
    asm volatile("" : "+v"(u));                                           \
  }                                                                       \
  double s = 0;                                                           \
  for (int i = 0; i < kChains; ++i) s += sum;                             \
  return s;

__attribute__((target("avx512f,avx512bw,avx512vnni"))) double int8_vnni512(int64_t n) {
  __m512i u = _mm512_set1_epi8(1), v = _mm512_set1_epi8(-1);
  TQ_PEAK_LOOP(__m512i, _mm512_setzero_si512(), _mm512_dpbusd_epi32(a[i], u, v), _mm512_reduce_add_epi32(a[i]))
}

__attribute__((target("avx2,fma"))) double int8_avx2(int64_t n) {
  __m256i u = _mm256_set1_epi8(1), v = _mm256_set1_epi8(-1);
  const __m256i one = _mm256_set1_epi16(1);
  TQ_PEAK_LOOP(__m256i, _mm256_setzero_si256(),
               _mm256_add_epi32(a[i], _mm256_madd_epi16(_mm256_maddubs_epi16(u, v), one)),
               _mm256_extract_epi32(a[i], 0))
}

__attribute__((target("avx512f,avx512bf16"))) double bf16_avx512(int64_t n) {
  __m512bh u = (__m512bh)_mm512_set1_epi16(0x3f80), v = u;
  TQ_PEAK_LOOP(__m512, _mm512_setzero_ps(), _mm512_dpbf16_ps(a[i], u, v), _mm512_reduce_add_ps(a[i]))
}

__attribute__((target("avx512f"))) double fp32_avx512(int64_t n) {
  __m512 u = _mm512_set1_ps(1.0f), v = _mm512_set1_ps(1e-9f);
  TQ_PEAK_LOOP(__m512, _mm512_setzero_ps(), _mm512_fmadd_ps(u, v, a[i]), _mm512_reduce_add_ps(a[i]))
}

__attribute__((target("avx2,fma"))) double fp32_avx2(int64_t n) {
  __m256 u = _mm256_set1_ps(1.0f), v = _mm256_set1_ps(1e-9f);
  TQ_PEAK_LOOP(__m256, _mm256_setzero_ps(), _mm256_fmadd_ps(u, v, a[i]), _mm256_cvtss_f32(a[i]))
}

#undef TQ_PEAK_LOOP

// Four independent tile products per iteration (tiles 0-3 += 4/5 x 6/7, each 16 x 16 x 64 int8).
__attribute__((target("amx-tile,amx-int8"))) double int8_amx(int64_t n) {
  struct alignas(64) {
    uint8_t palette = 1, start_row = 0;
    uint8_t reserved[14] = {};
    uint16_t colsb[16] = {};
    uint8_t rows[16] = {};
  } cfg;
  for (int t = 0; t < 8; ++t) {
    cfg.rows[t] = 16;
    cfg.colsb[t] = 64;
  }
  asm volatile("" : : "r"(&cfg) : "memory");  // ldtilecfg reads cfg (GCC 12 would drop the stores)
  _tile_loadconfig(&cfg);
  alignas(64) static const int8_t ones[16 * 64] = {1};
  alignas(64) int32_t out[16 * 16];
  _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
  _tile_loadd(4, ones, 64); _tile_loadd(5, ones, 64); _tile_loadd(6, ones, 64); _tile_loadd(7, ones, 64);
  for (int64_t it = 0; it < n; ++it) {
    _tile_dpbusd(0, 4, 6); _tile_dpbusd(1, 4, 7); _tile_dpbusd(2, 5, 6); _tile_dpbusd(3, 5, 7);
  }
  _tile_stored(0, out, 64);
  _tile_release();
  return out[0];
}

const Loop* find(const char* name) {
  // MACs per instruction: vpdpbusd zmm 64; maddubs+madd+add ymm 32 (three instructions); vdpbf16ps
  // zmm 32; vfmadd zmm 16, ymm 8
  static const Loop loops[] = {
      {"int8_vnni512", 64.0 * kChains, int8_vnni512, "avx512vnni"},
      {"int8_avx2", 32.0 * kChains, int8_avx2, "avx2"},
      {"bf16_avx512", 32.0 * kChains, bf16_avx512, "avx512bf16"},
      {"fp32_avx512", 16.0 * kChains, fp32_avx512, "avx512f"},
      {"fp32_avx2", 8.0 * kChains, fp32_avx2, "avx2"},
      {"int8_amx", 4.0 * 16 * 16 * 64, int8_amx, "amx"},
  };
  for (const Loop& l : loops)
    if (std::strcmp(l.name, name) == 0) return &l;
  return nullptr;
}

bool runs(const Loop& l) {
  __builtin_cpu_init();
  if (std::strcmp(l.feature, "avx512vnni") == 0)
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
           __builtin_cpu_supports("avx512vnni");
  if (std::strcmp(l.feature, "avx512bf16") == 0)
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bf16");
  if (std::strcmp(l.feature, "avx512f") == 0) return __builtin_cpu_supports("avx512f");
  if (std::strcmp(l.feature, "amx") == 0) return amx_ready();
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
}

}  // namespace peak
}  // namespace tq
