// The kernel table and the threaded drivers: Q8-activation GEMV/GEMM over the per-type
// micro-kernels, row dequantization and the embedding gather.
//
// Threads: at::parallel_for (torch's pool and thread count) over output rows; each thread
// streams its contiguous slice of the weight once per token chunk.
//
#include "quant_common.h"
#include "repacked.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <vector>

namespace tq {

int table_index(int qtype) {
  switch (qtype) {
    case kQ4_0: return 0;
    case kQ4_1: return 1;
    case kQ5_0: return 2;
    case kQ5_1: return 3;
    case kQ8_0: return 4;
    case kQ2_K: return 5;
    case kQ3_K: return 6;
    case kQ4_K: return 7;
    case kQ5_K: return 8;
    case kQ6_K: return 9;
    case kInt8: return 10;
    case kInt4: return 11;
    case kInt3: return 12;
    case kRepacked + kQ4_0: return 13;
    case kRepacked + kQ4_1: return 14;
    case kRepacked + kQ5_0: return 15;
    case kRepacked + kQ5_1: return 16;
    case kRepacked + kQ8_0: return 17;
    case kRepacked + kQ4_K: return 18;
    case kRepacked + kQ5_K: return 19;
    case kRepacked + kQ6_K: return 20;
    case kRepackedAmx + kQ4_0: return 21;
    case kRepackedAmx + kQ4_1: return 22;
    case kRepackedAmx + kQ5_0: return 23;
    case kRepackedAmx + kQ5_1: return 24;
    case kRepackedAmx + kQ8_0: return 25;
    case kRepackedAmx + kQ4_K: return 26;
    case kRepackedAmx + kQ5_K: return 27;
    case kRepackedAmx + kQ6_K: return 28;
    case kRepackedAvx2 + kQ4_0: return 29;
    case kRepackedAvx2 + kQ4_1: return 30;
    case kRepackedAvx2 + kQ5_0: return 31;
    case kRepackedAvx2 + kQ5_1: return 32;
    case kRepackedAvx2 + kQ8_0: return 33;
    case kRepackedAvx2 + kQ4_K: return 34;
    case kRepackedAvx2 + kQ5_K: return 35;
    case kRepackedAvx2 + kQ6_K: return 36;
    default: return -1;
  }
}

const TypeKernels* find_kernels(int qtype) {
  static const TypeKernels* table = [] {
    static TypeKernels t[kTableSize];
    register_legacy(t);
    register_kquants(t);
    register_kquants_low(t);
    register_kquants16(t);
    register_intq(t);
    register_repacked(t);  // after the types it decodes through
    return t;
  }();
  const int i = table_index(qtype);
  if (i < 0 || !table[i].deq) return nullptr;
  return &table[i];
}

// Rows per parallel task: enough work per task to hide the fork/join.
static int64_t row_grain(int64_t K, int64_t M) {
  const int64_t work = std::max<int64_t>(1, K * std::min<int64_t>(M, 16));
  return std::max<int64_t>(1, (int64_t)(1 << 16) / work);
}

// Cache tiling of the many-token case: a tile of weight rows (kRowTileBytes, in L2) meets a
// chunk of kTokenChunk tokens (their int8 activations, in L2 too); within it, each group of 4
// tokens (4 * K bytes, in L1) runs over every row of the tile.
constexpr int64_t kRowTileBytes = 96 << 10;
constexpr int64_t kTokenChunk = 64;

// Repacked layouts: each task takes a run of 16-row groups; within it, chunks of groups that fit in
// L2 (kGroupChunkBytes) meet every tile of up to kMaxT activation rows in turn.
constexpr int64_t kGroupChunkBytes = 256 << 10;

static void qgemm_tiles(const TypeKernels& k, const WView& w, int64_t N, const QAct& a, int64_t M, float* out) {
  const int64_t groups = N / kGroupRows, gbytes = kGroupRows * w.row_bytes;
  const int64_t chunk = std::max<int64_t>(1, kGroupChunkBytes / gbytes);
  const int64_t grain = std::max<int64_t>(1, (int64_t)(1 << 16) / (kGroupRows * w.K * std::min<int64_t>(M, kMaxT)));
  const int64_t amx_rows = k.amx ? M / kGroupRows * kGroupRows : 0;  // whole tiles of 16 rows: AMX
  at::parallel_for(0, groups, grain, [&](int64_t g0, int64_t g1) {
    if (amx_rows) {
      thread_local std::vector<uint8_t> scratch;
      if ((int64_t)scratch.size() < amx_scratch_bytes(w.K)) scratch.resize(amx_scratch_bytes(w.K));
      for (int64_t g = g0; g < g1; ++g)
        k.amx(w.data + g * gbytes, w.K, a, 0, amx_rows / kGroupRows, out + g * kGroupRows, N, scratch.data());
    }
    for (int64_t gc = g0; gc < g1; gc += chunk) {
      const int64_t ge = std::min(g1, gc + chunk);
      for (int64_t m = amx_rows; m < M; m += kMaxT) {
        const int64_t t = std::min<int64_t>(kMaxT, M - m);
        const TileFn fn = k.tile[t - 1];
        for (int64_t g = gc; g < ge; ++g) fn(w.data + g * gbytes, w.K, a, m, out + m * N + g * kGroupRows, N);
      }
    }
  });
}

void qgemm(const TypeKernels& k, const WView& w, int64_t N, const QAct& a, int64_t M, float* out) {
  if (k.tile[0]) {
    qgemm_tiles(k, w, N, a, M, out);
    return;
  }
  const int64_t rt = std::max<int64_t>(1, kRowTileBytes / std::max<int64_t>(1, w.row_bytes));
  const int64_t tmax = k.tokens(a.q16 != nullptr);
  at::parallel_for(0, N, row_grain(w.K, M), [&](int64_t n0, int64_t n1) {
    for (int64_t r0 = n0; r0 < n1; r0 += rt) {
      const int64_t r1 = std::min(n1, r0 + rt);
      for (int64_t mc = 0; mc < M; mc += kTokenChunk) {
        const int64_t mend = std::min(M, mc + kTokenChunk);
        for (int64_t m = mc; m < mend; m += tmax) {
          const int64_t t = std::min<int64_t>(tmax, mend - m);
          const DotFn dot = a.q16 ? k.dot16[t - 1] : k.dot[t - 1];
          for (int64_t n = r0; n < r1; ++n) dot(w, n, a, m, out + m * N + n, N);
        }
      }
    }
  });
}

void quantize_activations(const float* x, int64_t M, int64_t K, int64_t block, const QActBuf& out, bool residual) {
  if (M * K < (1 << 16)) {
    quantize_rows(x, K, block, 0, M, out, residual);
    return;
  }
  at::parallel_for(0, M, std::max<int64_t>(1, (1 << 14) / K), [&](int64_t m0, int64_t m1) {
    quantize_rows(x, K, block, m0, m1, out, residual);
  });
}

void quantize_activations16(const float* x, int64_t M, int64_t K, int64_t block, const QActBuf& out) {
  if (M * K < (1 << 16)) {
    quantize_rows16(x, K, block, 0, M, out);
    return;
  }
  at::parallel_for(0, M, std::max<int64_t>(1, (1 << 14) / K), [&](int64_t m0, int64_t m1) {
    quantize_rows16(x, K, block, m0, m1, out);
  });
}

void dequant_rows(const TypeKernels& k, const WView& w, int64_t n0, int64_t n1, float* out) {
  at::parallel_for(n0, n1, std::max<int64_t>(1, (1 << 15) / w.K), [&](int64_t a, int64_t b) {
    for (int64_t n = a; n < b; ++n) k.deq(w, n, out + (n - n0) * w.K);
  });
}

void gather_rows(const TypeKernels& k, const WView& w, const int64_t* ids, int64_t count, float* out) {
  at::parallel_for(0, count, std::max<int64_t>(1, (1 << 15) / w.K), [&](int64_t a, int64_t b) {
    for (int64_t i = a; i < b; ++i) k.deq(w, ids[i], out + i * w.K);
  });
}

}  // namespace tq
