// GGML rows <-> the interleaved layouts of repacked.h (done once, at load; plain C++).
//
// Each type is read as its 32-blocks of unsigned codes plus its header fields (scales, mins), and
// written back from them, so that unrepack_row(repack_group(rows)) gives the original bytes
// (tests/test_kernel_forms.py checks it bit for bit; dequantizing a repacked row goes through it).
#include "repacked.h"

#include <cstring>
#include <vector>

#include "quant_common.h"

namespace tq {
namespace {

// ---- one row's fields in the interleaved unit (row r of 16) ---------------------------------

void put_f16(uint8_t* dst, int r, const uint8_t* src) { dst[2 * r] = src[0]; dst[2 * r + 1] = src[1]; }
void get_f16(const uint8_t* src, int r, uint8_t* dst) { dst[0] = src[2 * r]; dst[1] = src[2 * r + 1]; }

void put_nib(uint8_t* nib, int r, const uint8_t* q) {
  for (int j = 0; j < 4; ++j)
    for (int i = 0; i < 4; ++i) nib[64 * j + 4 * r + i] = (uint8_t)((q[4 * j + i] & 15) | ((q[16 + 4 * j + i] & 15) << 4));
}
void get_nib(const uint8_t* nib, int r, uint8_t* q) {
  for (int j = 0; j < 4; ++j)
    for (int i = 0; i < 4; ++i) {
      const uint8_t b = nib[64 * j + 4 * r + i];
      q[4 * j + i] = b & 15;
      q[16 + 4 * j + i] = b >> 4;
    }
}

void put_hmask(uint8_t* hm, int r, const uint8_t* q) {  // hm zeroed beforehand
  for (int j = 0; j < 8; ++j)
    for (int i = 0; i < 4; ++i) {
      const int bit = 4 * r + i;
      hm[8 * j + bit / 8] |= (uint8_t)(((q[4 * j + i] >> 4) & 1) << (bit % 8));
    }
}
void get_hmask(const uint8_t* hm, int r, uint8_t* q) {
  for (int j = 0; j < 8; ++j)
    for (int i = 0; i < 4; ++i) {
      const int bit = 4 * r + i;
      q[4 * j + i] |= (uint8_t)(((hm[8 * j + bit / 8] >> (bit % 8)) & 1) << 4);
    }
}

void put_h2(uint8_t* h2, int r, const uint8_t* q) {  // h2 zeroed beforehand
  for (int t = 0; t < 2; ++t)
    for (int jj = 0; jj < 4; ++jj)
      for (int i = 0; i < 4; ++i) h2[64 * t + 4 * r + i] |= (uint8_t)(((q[4 * (4 * t + jj) + i] >> 4) & 3) << (2 * jj));
}
void get_h2(const uint8_t* h2, int r, uint8_t* q) {
  for (int t = 0; t < 2; ++t)
    for (int jj = 0; jj < 4; ++jj)
      for (int i = 0; i < 4; ++i) q[4 * (4 * t + jj) + i] |= (uint8_t)(((h2[64 * t + 4 * r + i] >> (2 * jj)) & 3) << 4);
}

void put_codes8(uint8_t* c8, int r, const uint8_t* q) {
  for (int j = 0; j < 8; ++j)
    for (int i = 0; i < 4; ++i) c8[64 * j + 4 * r + i] = q[4 * j + i];
}
void get_codes8(const uint8_t* c8, int r, uint8_t* q) {
  for (int j = 0; j < 8; ++j)
    for (int i = 0; i < 4; ++i) q[4 * j + i] = c8[64 * j + 4 * r + i];
}

// ---- the legacy types (32-blocks) -----------------------------------------------------------

struct Legacy {
  int bytes, qh, qs;  // block bytes; offsets of the fifth bits (-1: none) and of the codes
  bool m, q8;         // an fp16 min after d; int8 codes (Q8_0)
};

const Legacy* legacy(int t) {
  static const Legacy q4_0{18, -1, 2, false, false}, q4_1{20, -1, 4, true, false}, q5_0{22, 2, 6, false, false},
      q5_1{24, 4, 8, true, false}, q8_0{34, -1, 2, false, true};
  switch (t) {
    case kQ4_0: return &q4_0;
    case kQ4_1: return &q4_1;
    case kQ5_0: return &q5_0;
    case kQ5_1: return &q5_1;
    case kQ8_0: return &q8_0;
    default: return nullptr;
  }
}

void legacy_codes(const Legacy& L, const uint8_t* b, uint8_t q[32]) {
  if (L.q8) {
    for (int i = 0; i < 32; ++i) q[i] = (uint8_t)((int)(int8_t)b[L.qs + i] + 128);
    return;
  }
  const uint32_t qh = L.qh >= 0 ? load_u32(b + L.qh) : 0;
  for (int i = 0; i < 16; ++i) {
    q[i] = (uint8_t)((b[L.qs + i] & 15) | (((qh >> i) & 1) << 4));
    q[16 + i] = (uint8_t)((b[L.qs + i] >> 4) | (((qh >> (16 + i)) & 1) << 4));
  }
}

void legacy_encode(const Legacy& L, const uint8_t q[32], uint8_t* b) {
  if (L.q8) {
    for (int i = 0; i < 32; ++i) b[L.qs + i] = (uint8_t)(int8_t)((int)q[i] - 128);
    return;
  }
  uint32_t qh = 0;
  for (int i = 0; i < 16; ++i) b[L.qs + i] = (uint8_t)((q[i] & 15) | ((q[16 + i] & 15) << 4));
  for (int i = 0; i < 32; ++i) qh |= (uint32_t)((q[i] >> 4) & 1) << i;
  if (L.qh >= 0) std::memcpy(b + L.qh, &qh, 4);
}

int64_t legacy_unit(const Legacy& L) { return (int64_t)kGroupRows * L.bytes; }

// unit layout offsets: d | m | hmask | nib, or d | codes8
void legacy_offsets(const Legacy& L, int* m, int* hm, int* codes) {
  int o = 32;
  *m = L.m ? o : -1;
  o += L.m ? 32 : 0;
  *hm = L.qh >= 0 ? o : -1;
  o += L.qh >= 0 ? 64 : 0;
  *codes = o;
}

void repack_legacy(const Legacy& L, const uint8_t* src, int64_t row_bytes, int64_t K, uint8_t* dst) {
  int mo, hmo, co;
  legacy_offsets(L, &mo, &hmo, &co);
  uint8_t q[32];
  for (int64_t b = 0; b < K / 32; ++b) {
    uint8_t* u = dst + b * legacy_unit(L);
    for (int r = 0; r < kGroupRows; ++r) {
      const uint8_t* blk = src + r * row_bytes + b * L.bytes;
      put_f16(u, r, blk);
      if (mo >= 0) put_f16(u + mo, r, blk + 2);
      legacy_codes(L, blk, q);
      if (L.q8) {
        put_codes8(u + co, r, q);
        continue;
      }
      if (hmo >= 0) put_hmask(u + hmo, r, q);
      put_nib(u + co, r, q);
    }
  }
}

void unrepack_legacy(const Legacy& L, const uint8_t* group, int r, int64_t K, uint8_t* dst) {
  int mo, hmo, co;
  legacy_offsets(L, &mo, &hmo, &co);
  uint8_t q[32];
  for (int64_t b = 0; b < K / 32; ++b) {
    const uint8_t* u = group + b * legacy_unit(L);
    uint8_t* blk = dst + b * L.bytes;
    get_f16(u, r, blk);
    if (mo >= 0) get_f16(u + mo, r, blk + 2);
    if (L.q8) {
      get_codes8(u + co, r, q);
    } else {
      get_nib(u + co, r, q);
      if (hmo >= 0) get_hmask(u + hmo, r, q);
    }
    legacy_encode(L, q, blk);
  }
}

// ---- the k-quants (256 super-blocks of 8 32-blocks) --------------------------------------------

// Codes of 32-block bb (0..7) of a Q4_K / Q5_K / Q6_K super-block, and their inverse.
void k_codes(int t, const uint8_t* sb, int bb, uint8_t q[32]) {
  if (t == kQ6_K) {
    const int h = bb / 4, p = bb % 4;
    const uint8_t* lo = sb + 64 * h + 32 * (p & 1);
    const uint8_t* qh = sb + 128 + 32 * h;
    for (int i = 0; i < 32; ++i) {
      const int low = p < 2 ? (lo[i] & 15) : (lo[i] >> 4);
      q[i] = (uint8_t)(low | (((qh[i] >> (2 * p)) & 3) << 4));
    }
    return;
  }
  const bool q5 = t == kQ5_K;
  const uint8_t* qs = sb + (q5 ? 48 : 16) + 32 * (bb / 2);
  for (int i = 0; i < 32; ++i) {
    int v = (bb & 1) ? (qs[i] >> 4) : (qs[i] & 15);
    if (q5) v |= ((sb[16 + i] >> bb) & 1) << 4;
    q[i] = (uint8_t)v;
  }
}

void k_encode(int t, int bb, const uint8_t q[32], uint8_t* sb) {  // sb's code bytes zeroed beforehand
  if (t == kQ6_K) {
    const int h = bb / 4, p = bb % 4;
    uint8_t* lo = sb + 64 * h + 32 * (p & 1);
    uint8_t* qh = sb + 128 + 32 * h;
    for (int i = 0; i < 32; ++i) {
      lo[i] |= (uint8_t)(p < 2 ? (q[i] & 15) : ((q[i] & 15) << 4));
      qh[i] |= (uint8_t)(((q[i] >> 4) & 3) << (2 * p));
    }
    return;
  }
  const bool q5 = t == kQ5_K;
  uint8_t* qs = sb + (q5 ? 48 : 16) + 32 * (bb / 2);
  for (int i = 0; i < 32; ++i) {
    qs[i] |= (uint8_t)((bb & 1) ? ((q[i] & 15) << 4) : (q[i] & 15));
    if (q5) sb[16 + i] |= (uint8_t)(((q[i] >> 4) & 1) << bb);
  }
}

int k_bytes(int t) { return t == kQ4_K ? 144 : t == kQ5_K ? 176 : 210; }

void repack_kquant(int t, const uint8_t* src, int64_t row_bytes, int64_t K, uint8_t* dst) {
  const int64_t unit = (int64_t)kGroupRows * k_bytes(t);
  uint8_t q[32];
  for (int64_t s = 0; s < K / 256; ++s) {
    uint8_t* u = dst + s * unit;
    for (int r = 0; r < kGroupRows; ++r) {
      const uint8_t* sb = src + r * row_bytes + s * k_bytes(t);
      if (t == kQ6_K) {
        put_f16(u, r, sb + 208);
        for (int j = 0; j < 16; ++j) u[32 + 16 * j + r] = sb[192 + j];
        for (int bb = 0; bb < 8; ++bb) {
          k_codes(t, sb, bb, q);
          put_nib(u + 288 + 384 * bb, r, q);
          put_h2(u + 288 + 384 * bb + 256, r, q);
        }
        continue;
      }
      put_f16(u, r, sb);
      put_f16(u + 32, r, sb + 2);
      for (int w = 0; w < 3; ++w) std::memcpy(u + 64 + 64 * w + 4 * r, sb + 4 + 4 * w, 4);
      const int hm = 256, nib = t == kQ5_K ? 256 + 512 : 256;
      for (int bb = 0; bb < 8; ++bb) {
        k_codes(t, sb, bb, q);
        if (t == kQ5_K) put_hmask(u + hm + 64 * bb, r, q);
        put_nib(u + nib + 256 * bb, r, q);
      }
    }
  }
}

void unrepack_kquant(int t, const uint8_t* group, int r, int64_t K, uint8_t* dst) {
  const int64_t unit = (int64_t)kGroupRows * k_bytes(t);
  uint8_t q[32];
  for (int64_t s = 0; s < K / 256; ++s) {
    const uint8_t* u = group + s * unit;
    uint8_t* sb = dst + s * k_bytes(t);
    std::memset(sb, 0, k_bytes(t));
    if (t == kQ6_K) {
      get_f16(u, r, sb + 208);
      for (int j = 0; j < 16; ++j) sb[192 + j] = u[32 + 16 * j + r];
      for (int bb = 0; bb < 8; ++bb) {
        get_nib(u + 288 + 384 * bb, r, q);
        get_h2(u + 288 + 384 * bb + 256, r, q);
        k_encode(t, bb, q, sb);
      }
      continue;
    }
    get_f16(u, r, sb);
    get_f16(u + 32, r, sb + 2);
    for (int w = 0; w < 3; ++w) std::memcpy(sb + 4 + 4 * w, u + 64 + 64 * w + 4 * r, 4);
    const int hm = 256, nib = t == kQ5_K ? 256 + 512 : 256;
    for (int bb = 0; bb < 8; ++bb) {
      get_nib(u + nib + 256 * bb, r, q);
      if (t == kQ5_K) get_hmask(u + hm + 64 * bb, r, q);
      k_encode(t, bb, q, sb);
    }
  }
}

bool is_kquant(int t) { return t == kQ4_K || t == kQ5_K || t == kQ6_K; }

// Row n of a repacked weight: its original bytes (unrepack_row), decoded by the original type's deq.
template <int T>
void deq_repacked(const WView& w, int64_t n, float* out) {
  thread_local std::vector<uint8_t> raw;
  if ((int64_t)raw.size() < w.row_bytes) raw.resize(w.row_bytes);
  unrepack_row(T, w.data + (n / kGroupRows) * kGroupRows * w.row_bytes, (int)(n % kGroupRows), w.row_bytes, w.K,
               raw.data());
  WView one = w;
  one.data = raw.data();
  find_kernels(T)->deq(one, 0, out);
}

template <int T>
void set_repacked(TypeKernels* table) {
  const TypeKernels& base = table[table_index(T)];
  for (int id : {kRepacked + T, kRepackedAmx + T, kRepackedAvx2 + T}) {
    TypeKernels& k = table[table_index(id)];
    k.block = base.block;
    k.bytes = base.bytes;
    k.act_block = 32;
    k.base = T;
    k.deq = deq_repacked<T>;
  }
}

}  // namespace

void register_repacked(TypeKernels* table) {
  set_repacked<kQ4_0>(table); set_repacked<kQ4_1>(table); set_repacked<kQ5_0>(table); set_repacked<kQ5_1>(table);
  set_repacked<kQ8_0>(table); set_repacked<kQ4_K>(table); set_repacked<kQ5_K>(table); set_repacked<kQ6_K>(table);
  vavx2::register_avx2_tiles(table);  // AVX2: the module's own base target
  if (cpu_has_vnni512()) v512::register_vnni512(table);
  if (amx_ready()) amx::register_amx(table);
}

bool cpu_has_vnni512() {
#if defined(__x86_64__) && defined(__GNUC__)
  // libgcc's checks include the OS's XCR0 support for the zmm state
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq") &&
         __builtin_cpu_supports("avx512vnni");
#else
  return false;
#endif
}

bool repackable(int t) { return legacy(t) != nullptr || is_kquant(t); }

void repack_group(int t, const uint8_t* src, int64_t row_bytes, int64_t K, uint8_t* dst) {
  std::memset(dst, 0, (size_t)(kGroupRows * row_bytes));
  if (const Legacy* L = legacy(t)) repack_legacy(*L, src, row_bytes, K, dst);
  else repack_kquant(t, src, row_bytes, K, dst);
}

void unrepack_row(int t, const uint8_t* group, int r, int64_t row_bytes, int64_t K, uint8_t* dst) {
  (void)row_bytes;
  if (const Legacy* L = legacy(t)) unrepack_legacy(*L, group, r, K, dst);
  else unrepack_kquant(t, group, r, K, dst);
}

}  // namespace tq
