// The AMX form of the repacked matmuls: the integer block sums of 16 activation rows x 16 weight rows
// in one tile multiply (tdpbsud: signed int8 activations x unsigned codes), then the same float steps
// as the AVX-512 VNNI tile kernels (qmm_units.h add_block / add_min), lane for lane. The integer sums
// are exact either way, so a row gives the same bits through this kernel as through qmm_vnni512.cpp:
// the driver (quant_gemm.cpp) gives whole tiles of 16 rows to this one and the rest to those.
//
// Per group of 16 weight rows: its codes are unpacked once into a B-tile image in `scratch` (per
// 32-block 8 rows of 64 bytes: quad j of the 16 rows, the layout tdpbsud reads) with the weight
// scales and mins as fp32 vectors; then each tile of 16 activation rows walks the blocks: load A
// (16 rows x 32 inputs, or 16 for Q6_K's sub-blocks), multiply into C, store C, and add its 16 rows.
// The integer work per 32-block falls from 128 vpdpbusd to one tile multiply; the float steps stay.
//
// AMX needs the kernel's permission for the tile state (arch_prctl ARCH_REQ_XCOMP_PERM, once per
// process: amx_ready) and a tile configuration per thread, loaded at the start of each group's call
// and released at its end (other libraries in the process, oneDNN among them, configure tiles of
// their own on the same threads).
#include <cstdint>
#include <cstring>
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "quant_common.h"
#include "repacked.h"

#pragma GCC push_options
#pragma GCC target("amx-tile,amx-int8,avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c,bmi,bmi2")

namespace tq {
namespace amx {
namespace {

#include "qmm_units.h"

struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// Two of each, so that one step's multiply runs while the other step's sums are added:
// tiles 0, 1: A (16 activation rows x SUB bytes); 2, 3: B (SUB / 4 quads x 64 bytes); 4, 5: C (16 x 16 int32)
template <int SUB>
void configure() {
  TileConfig c;
  for (int t = 0; t < 2; ++t) {
    c.rows[t] = 16; c.colsb[t] = SUB;
    c.rows[2 + t] = SUB / 4; c.colsb[2 + t] = 64;
    c.rows[4 + t] = 16; c.colsb[4 + t] = 64;
  }
  // GCC 12 does not see ldtilecfg read the whole struct and drops the stores above without this barrier
  asm volatile("" : : "r"(&c) : "memory");
  _tile_loadconfig(&c);
}

// C = A . B of step i (block i / subs, sub-block i % subs) in tiles (A, B, C); the tile intrinsics take
// their tile numbers as literals, hence a macro.
#define TQ_AMX_MULTIPLY(A, B, C, xq, K, codes, i, SUB)                                    \
  do {                                                                                  \
    const int64_t b_ = (i) / (32 / (SUB)), s_ = (i) % (32 / (SUB));                     \
    _tile_zero(C);                                                                      \
    _tile_loadd(A, (xq) + 32 * b_ + (SUB) * s_, (K));                                   \
    _tile_loadd(B, (codes) + b_ * 512 + s_ * ((SUB) / 4) * 64, 64);                     \
    _tile_dpbsud(C, A, B);                                                              \
  } while (0)

template <class D>
void group_tiles(const uint8_t* grp, int64_t K, const QAct& a, int64_t m0, int64_t tiles, float* out, int64_t ldo,
                 uint8_t* scratch) {
  constexpr int kSubs = 32 / D::kSub;
  static_assert(!D::kMin || kSubs == 1, "a min is added once per block, after its one sub-block");
  const int64_t nb = K / 32;
  uint8_t* codes = scratch;                                      // nb x 512 bytes
  float* ws = reinterpret_cast<float*>(scratch + nb * 512);      // nb x kSubs x 16
  float* wm = ws + nb * kSubs * 16;                              // nb x 16 (types with a min)
  for (int64_t un = 0; un < K / D::kUnit; ++un) {
    const D U(grp + un * D::kBytes);
    for (int bb = 0; bb < D::kUnit / 32; ++bb) {
      const int64_t b = un * (D::kUnit / 32) + bb;
      __m512i w[8];
      U.codes(bb, w);
      for (int j = 0; j < 8; ++j) _mm512_storeu_si512(codes + b * 512 + 64 * j, w[j]);
      for (int s = 0; s < kSubs; ++s) _mm512_storeu_ps(ws + (b * kSubs + s) * 16, U.scale(bb, s));
      if constexpr (D::kMin) _mm512_storeu_ps(wm + b * 16, U.minv(bb));
    }
  }
  configure<D::kSub>();
  alignas(64) int32_t c[16 * 16];
  const int64_t steps = nb * kSubs;
  for (int64_t t = 0; t < tiles; ++t) {
    const int64_t mt = m0 + 16 * t;
    __m512 acc[16];
    for (int m = 0; m < 16; ++m) acc[m] = _mm512_setzero_ps();
    const int8_t* xq = a.q + mt * K;
    const float* xd = a.d + mt * nb;
    // step i's sums, from C stored at c, into the 16 rows' accumulators
    auto add = [&](int64_t i) {
      const int64_t b = i / kSubs, s = i % kSubs;
      const __m512 wsv = _mm512_loadu_ps(ws + i * 16);
#pragma GCC unroll 16
      for (int m = 0; m < 16; ++m) {
        __m512i isum = _mm512_load_si512(c + 16 * m);
        if constexpr (D::kOff != 0) isum = _mm512_add_epi32(isum, _mm512_set1_epi32(a.init[(mt + m) * steps + i]));
        acc[m] = add_block(acc[m], isum, wsv, xd[m * nb + b]);
      }
      if constexpr (D::kMin) {  // one sub-block per block
        const __m512 mv = _mm512_loadu_ps(wm + b * 16);
#pragma GCC unroll 16
        for (int m = 0; m < 16; ++m) acc[m] = add_min<D>(acc[m], mv, a.s32[(mt + m) * nb + b]);
      }
    };
    TQ_AMX_MULTIPLY(0, 2, 4, xq, K, codes, 0, D::kSub);
    for (int64_t i = 0; i < steps; i += 2) {
      if (i + 1 < steps) TQ_AMX_MULTIPLY(1, 3, 5, xq, K, codes, i + 1, D::kSub);
      _tile_stored(4, c, 64);
      add(i);
      if (i + 1 >= steps) break;
      if (i + 2 < steps) TQ_AMX_MULTIPLY(0, 2, 4, xq, K, codes, i + 2, D::kSub);
      _tile_stored(5, c, 64);
      add(i + 1);
    }
    for (int m = 0; m < 16; ++m) _mm512_storeu_ps(out + (mt + m) * ldo, acc[m]);
  }
  _tile_release();
}

#undef TQ_AMX_MULTIPLY

}  // namespace

// The group kernels of the amx form's type ids (kRepackedAmx + a GGML id; their remainder rows take
// the VNNI tiles register_vnni512 sets in the same slots).
void register_amx(TypeKernels* table) {
  each_unit([&]<class D>(int ggml, D*) { table[table_index(kRepackedAmx + ggml)].amx = group_tiles<D>; });
}

}  // namespace amx

}  // namespace tq

#pragma GCC pop_options

namespace tq {

// Outside the target pragma: called on every CPU.
bool amx_ready() {
#if defined(__x86_64__) && defined(__linux__)
  static const bool ready = [] {
    if (!cpu_has_vnni512() || !__builtin_cpu_supports("amx-tile") || !__builtin_cpu_supports("amx-int8")) return false;
    constexpr long kReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;  // the kernel's AMX permission request
    return syscall(SYS_arch_prctl, kReqXcompPerm, kXfeatureXtiledata) == 0;
  }();
  return ready;
#else
  return false;
#endif
}

}  // namespace tq
