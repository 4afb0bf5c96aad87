// The AVX-512 VNNI kernel form of the quantized matmuls: tiles of MR activation rows (1..8) by one
// group of 16 weight rows in the interleaved layouts of repacked.h, int8 activations in blocks of 32.
//
// Per 32-block and sub-block (32 inputs, or 16 for Q6_K), each of the MR rows runs
//   isum = init + sum_j vpdpbusd(codes quad j of 16 weight rows, 4 inputs broadcast)   (exact, int32)
//   acc  = fma(float(isum), w_scale * d_x, acc)
// and, for the types with a min, acc = acc +/- w_min * s32_x (s32 = d_x * the block's integer sum).
// `init` (per activation row and sub-block, QAct::init) is -off * the integer sum of the inputs, so
// that unsigned codes with an offset (Q4_0: q - 8, Q8_0: stored + 128, Q6_K: q - 32) give the exact
// integer dot product. Each output lane's operations are the same for MR = 1 and MR = 8: a row's
// result does not depend on the rows beside it (row invariance at any batch size).
//
// Compiled for AVX-512 F/BW/VL/DQ + VNNI by the target pragma below, whatever the module's own
// flags; only called when the CPU has them (forms() in quant_ops.cpp). Everything before the
// pragma (the standard headers) keeps the module's base target, so no inline function shared with
// the other translation units is compiled for a CPU that may lack these instructions.
#include <cstdint>
#include <cstring>
#include <immintrin.h>

#include "quant_common.h"
#include "repacked.h"

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c,bmi,bmi2")

namespace tq {
namespace v512 {
namespace {

#include "qmm_units.h"

// ---- the tile kernel ---------------------------------------------------------------------------

template <class D, int MR>
void tile(const uint8_t* grp, int64_t K, const QAct& a, int64_t m0, float* out, int64_t ldo) {
  constexpr int kSubs = 32 / D::kSub, kQuads = D::kSub / 4;
  const int64_t nb = K / 32;
  __m512 acc[MR];
  const int8_t* xq[MR];
  const float *xd[MR], *xs[MR];
  const int32_t* xi[MR];
  for (int m = 0; m < MR; ++m) {
    acc[m] = _mm512_setzero_ps();
    xq[m] = a.q + (m0 + m) * K;
    xd[m] = a.d + (m0 + m) * nb;
    xs[m] = D::kMin ? a.s32 + (m0 + m) * nb : nullptr;
    xi[m] = D::kOff ? a.init + (m0 + m) * nb * kSubs : nullptr;
  }
  for (int64_t un = 0; un < K / D::kUnit; ++un) {
    const uint8_t* up = grp + un * D::kBytes;
    // one line in four, 4 KB ahead (the hardware prefetcher follows the stream; at one row the kernel reads
    // 19-22 GB/s of the 22-24 this VM's threads read, measured 2026-12-06)
    for (int l = 0; l < D::kBytes; l += 64 * 4) _mm_prefetch(reinterpret_cast<const char*>(up + 4096 + l), _MM_HINT_T0);
    const D U(up);
#pragma GCC unroll 8
    for (int bb = 0; bb < D::kUnit / 32; ++bb) {
      const int64_t b = un * (D::kUnit / 32) + bb;
      __m512i w[8];
      U.codes(bb, w);
#pragma GCC unroll 2
      for (int s = 0; s < kSubs; ++s) {
        const __m512 ws = U.scale(bb, s);
        // the MR rows' integer sums side by side: MR independent chains of vpdpbusd
        __m512i ia[MR];
#pragma GCC unroll 8
        for (int m = 0; m < MR; ++m) ia[m] = D::kOff ? _mm512_set1_epi32(xi[m][b * kSubs + s]) : _mm512_setzero_si512();
#pragma GCC unroll 8
        for (int j = 0; j < kQuads; ++j) {
#pragma GCC unroll 8
          for (int m = 0; m < MR; ++m)
            ia[m] = _mm512_dpbusd_epi32(ia[m], w[s * kQuads + j], _mm512_set1_epi32(ld32(xq[m] + 32 * b + D::kSub * s + 4 * j)));
        }
#pragma GCC unroll 8
        for (int m = 0; m < MR; ++m) acc[m] = add_block(acc[m], ia[m], ws, xd[m][b]);
      }
      if constexpr (D::kMin) {
        const __m512 mv = U.minv(bb);
        for (int m = 0; m < MR; ++m) acc[m] = add_min<D>(acc[m], mv, xs[m][b]);
      }
    }
  }
  for (int m = 0; m < MR; ++m) _mm512_storeu_ps(out + m * ldo, acc[m]);
}

template <class D>
void fill(TypeKernels& k) {
  k.tile[0] = tile<D, 1>; k.tile[1] = tile<D, 2>; k.tile[2] = tile<D, 3>; k.tile[3] = tile<D, 4>;
  k.tile[4] = tile<D, 5>; k.tile[5] = tile<D, 6>; k.tile[6] = tile<D, 7>; k.tile[7] = tile<D, 8>;
  k.act_off = D::kOff;
  k.act_sub = D::kSub;
}

}  // namespace

// The tile kernels of each repacked type (TypeKernels::tile), set in the slots of `table`: the
// avx512_vnni form's type ids and the amx form's (the same layouts; their whole tiles of 16 rows go to
// qmm_amx.cpp, the rest to these).
void register_vnni512(TypeKernels* table) {
  for (int base : {kRepacked, kRepackedAmx})
    each_unit([&]<class D>(int ggml, D*) { fill<D>(table[table_index(base + ggml)]); });
}

}  // namespace v512
}  // namespace tq

#pragma GCC pop_options
