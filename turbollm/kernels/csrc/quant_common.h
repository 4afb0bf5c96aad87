// Shared declarations of the quantized-matmul kernels (turbollm/kernels/quant.py is the reference).
//
// Plain C++ (no torch headers) so that the kernel translation units compile quickly; only
// quant_ops.cpp includes torch.
//
// Activations are quantized per block to int8 with one fp32 scale d = amax / 127 and
// q = round_half_even(x * (1 / d)), in one of two block sizes (a weight type names the one
// its kernels read, TypeKernels::act_block):
// - 32 (legacy types, int8, int4, int3): per block also s32 = d * sum(q) and, per 16-wide half,
//   s16 = d * sum(q), so that a weight a * q_w + c contributes a * d * (q_w . q_x) + c * s;
// - 256 (k-quants, ggml's Q8_K idea): one scale per super-block, so the integer products of all
//   sub-blocks (times their integer scales) add up in int32 before one float conversion; the
//   integer sums of each 16 values, bs16, serve the mins / offsets.
//
// 16-bit activations (q16: d = amax / 32767, one level) come in the type's block too (32, or 256 for
// Q4_K / Q5_K / Q6_K), with s32 / s16 (d * the integer sums of each 32 / 16) whatever the block.
//
// A kernel computes out[t] = dot(weight row n, activation row m0 + t) for t < T (T = 1..kMaxT
// tokens at once), decoding each weight block once for the T tokens.
#pragma once
#include <cstdint>
#include <cstring>
#ifdef __AVX2__
#include <immintrin.h>
#endif

namespace tq {

constexpr int kMaxT = 8;  // most tokens per micro-kernel call (types fill dot[0..tokens - 1])

// The quantized activations of M rows; row m of each array starts at m * (K / width).
struct QAct {
  const int8_t* q = nullptr;      // [M, K]
  const int16_t* q16 = nullptr;   // 16-bit activations ("q16"): [M, K] instead of q (s32, s16 always)
  const float* d = nullptr;       // [M, K / block]
  const float* s32 = nullptr;     // block 32, and 16-bit activations of either block: [M, K / 32]
  const float* s16 = nullptr;     // the same: [M, K / 16]
  const int16_t* bs16 = nullptr;  // block 256: [M, K / 16]
  const int32_t* init = nullptr;  // tile kernels of a type with an offset: [M, K / act_sub], -off * sum(q)
  int64_t K = 0;
  int64_t block = 32;
  inline const int8_t* qrow(int64_t m) const { return q + m * K; }
  inline const int16_t* q16row(int64_t m) const { return q16 + m * K; }
  inline const float* drow(int64_t m) const { return d + m * (K / block); }
  inline const float* s32row(int64_t m) const { return s32 + m * (K / 32); }
  inline const float* s16row(int64_t m) const { return s16 + m * (K / 16); }
  inline const int16_t* bs16row(int64_t m) const { return bs16 + m * (K / 16); }
};

// Writable buffers of a QAct (the arrays of the other block size may be null).
struct QActBuf {
  int8_t* q = nullptr;
  int16_t* q16 = nullptr;  // set (and q null) for 16-bit activations
  float* d = nullptr;
  float* s32 = nullptr;
  float* s16 = nullptr;
  int16_t* bs16 = nullptr;
};

// A weight matrix of N rows of K values. GGML types use data/row_bytes; int8 per-channel adds
// scale[N]; int4 / int3 group-wise add scale/zero [N, K / group].
struct WView {
  const uint8_t* data = nullptr;
  int64_t row_bytes = 0;
  int64_t K = 0;
  const float* scale = nullptr;      // int8: float32 [N]
  const uint8_t* scale16 = nullptr;  // int4 / int3: float16 [N, K / group] (raw bytes, 2 per value)
  const uint8_t* zero8 = nullptr;    // int4 / int3: uint8 [N, K / group]
  int64_t group = 0;
  inline const uint8_t* row(int64_t n) const { return data + n * row_bytes; }
};

// out[t * ostride] = dot(row n of w, activation row m0 + t), t < T (T is the template count).
using DotFn = void (*)(const WView& w, int64_t n, const QAct& a, int64_t m0, float* out, int64_t ostride);
// Row n of w as K float32 values (bit-exact with the PyTorch decoders).
using DeqFn = void (*)(const WView& w, int64_t n, float* out);
// Repacked layouts (repacked.h): out[m * ldo + c] = dot(row c of the 16-row group at `group`,
// activation row m0 + m) for m < MR (the template count), c < 16.
using TileFn = void (*)(const uint8_t* group, int64_t K, const QAct& a, int64_t m0, float* out, int64_t ldo);
// The amx form: `tiles` tiles of 16 activation rows from m0 against one group, `scratch` holding at least
// amx_scratch_bytes(K) bytes (the group's codes as B tiles, its scales as fp32).
using AmxFn = void (*)(const uint8_t* group, int64_t K, const QAct& a, int64_t m0, int64_t tiles, float* out,
                       int64_t ldo, uint8_t* scratch);
inline int64_t amx_scratch_bytes(int64_t K) { return K / 32 * (512 + 3 * 64); }

struct TypeKernels {
  int block = 0;          // values per block
  int bytes = 0;          // bytes per block
  int act_block = 32;     // activation block size the dot kernels read (32 or 256)
  DotFn dot[kMaxT] = {};  // dot[T - 1] handles T tokens; null when only dequant exists
  DotFn dot16[kMaxT] = {};  // the same with 16-bit activations (QAct::q16); null when the type has none
  // The dot kernels read each 32-block of the activations as its 16 even columns, then its 16 odd
  // ones (linear_q8 reorders the quantized activations so): types whose packing interleaves the
  // two (int4: the even column in the low nibble) then need no unpacking shuffles.
  bool act_even_odd = false;
  // The same for the 16-bit activations alone (the k-quants' dot16 kernels: their int8 ones keep
  // the column order).
  bool act16_even_odd = false;
  DeqFn deq = nullptr;
  // The repacked layouts' tile kernels (tile[MR - 1] takes MR activation rows; null when the CPU
  // cannot run them), the offset their integer sums take (QAct::init = -act_off * the sum of each
  // act_sub inputs; 0: none) and the GGML type they were repacked from.
  TileFn tile[kMaxT] = {};
  AmxFn amx = nullptr;  // the amx form's type ids, where the CPU and the OS run AMX tiles
  int act_off = 0;
  int act_sub = 32;
  int base = 0;
  // Tokens per call of the dot (sixteen = false) or dot16 kernels: the count of filled slots.
  int tokens(bool sixteen) const {
    const DotFn* f = sixteen ? dot16 : dot;
    int t = 0;
    while (t < kMaxT && f[t]) ++t;
    return t;
  }
};

// GGML type ids (gguf.GGMLQuantizationType) plus two ids of our own for the non-GGML formats.
enum : int {
  kQ4_0 = 2, kQ4_1 = 3, kQ5_0 = 6, kQ5_1 = 7, kQ8_0 = 8,
  kQ2_K = 10, kQ3_K = 11, kQ4_K = 12, kQ5_K = 13, kQ6_K = 14,
  kInt8 = 1000, kInt4 = 1001, kInt3 = 1002,
};
// (kRepacked + a GGML id, 2000..: the interleaved layouts of repacked.h)

// The kernels of a type id, or nullptr. Each family file fills its types.
const TypeKernels* find_kernels(int qtype);
void register_legacy(TypeKernels* table);   // quant_dot_legacy.cpp (Q4_0..Q8_0)
void register_kquants(TypeKernels* table);  // quant_dot_kquants.cpp (Q4_K, Q5_K, Q6_K)
void register_kquants_low(TypeKernels* table);  // quant_dot_klow.cpp (Q2_K, Q3_K)
void register_kquants16(TypeKernels* table);  // quant_dot_kquants16.cpp (Q4_K, Q5_K, Q6_K with 16-bit activations)
void register_intq(TypeKernels* table);     // quant_dot_int.cpp (int8 per-channel, int4 / int3 group-wise)
void register_repacked(TypeKernels* table);  // quant_repack.cpp (the repacked layouts: sizes, dequantization)
namespace vavx2 {
void register_avx2_tiles(TypeKernels* table);  // qmm_avx2.cpp (their AVX2 tile kernels: the avx2_tiles form)
}
namespace v512 {
void register_vnni512(TypeKernels* table);  // qmm_vnni512.cpp (their AVX-512 VNNI tile kernels)
}
namespace amx {
void register_amx(TypeKernels* table);      // qmm_amx.cpp (the amx form's group kernels)
}
bool cpu_has_vnni512();                     // quant_repack.cpp: AVX-512 F/BW/VL/DQ + VNNI, and the OS saves zmm state
bool amx_ready();                           // qmm_amx.cpp: AMX-INT8 tiles, and the kernel's permission for them
int table_index(int qtype);                 // slot of qtype in the table, or -1
constexpr int kTableSize = 37;

// quant_act.cpp: quantize rows [m0, m1) of x [M, K] in blocks of `block` (32 or 256). With
// `residual`, row m becomes two rows of the output: 2m (x) and 2m + 1 (x minus the first's
// dequantized values, quantized with its own scales), so that x ~ d1 q1 + d2 q2.
void quantize_rows(const float* x, int64_t K, int64_t block, int64_t m0, int64_t m1, const QActBuf& out,
                   bool residual);
// 16-bit activations in blocks of `block` (32, or 256 for the k-quants): d = amax / 32767,
// q16 = round_half_even(x * (1 / d)), s32 / s16 = d * the integer sums of each 32 / 16 values
// (whatever the block). One level, ~the precision of the two 8-bit ones.
void quantize_rows16(const float* x, int64_t K, int64_t block, int64_t m0, int64_t m1, const QActBuf& out);

// quant_gemm.cpp: the threaded drivers (at::parallel_for over output rows).
void quantize_activations(const float* x, int64_t M, int64_t K, int64_t block, const QActBuf& out, bool residual);
void quantize_activations16(const float* x, int64_t M, int64_t K, int64_t block, const QActBuf& out);
// init[r * (K / sub) + s] = -off * the sum of q over inputs [s sub, (s + 1) sub) of row r (R rows)
void offset_sums(const int8_t* q, int64_t R, int64_t K, int64_t sub, int64_t off, int32_t* init);
// out [M, N]; 16-bit activations (a.q16) take the type's dot16 kernels
void qgemm(const TypeKernels& k, const WView& w, int64_t N, const QAct& a, int64_t M, float* out);
void dequant_rows(const TypeKernels& k, const WView& w, int64_t n0, int64_t n1, float* out);  // [n1 - n0, K]
void gather_rows(const TypeKernels& k, const WView& w, const int64_t* ids, int64_t count, float* out);

// ---------------------------------------------------------------------------------------------
// small helpers

// Software prefetch of the weight bytes kPrefetchDistance ahead of those being decoded (rows of
// a thread's slice are contiguous, so this runs on into the next rows): the kernels are close to
// compute-bound, and the hardware prefetcher alone leaves part of the DRAM latency exposed.
// Measured at batch 1, 1 thread, cold weights: 4096 bytes gave +15-40% (Q4_K 12.3 -> 14.5-16.6
// GB/s, Q6_K +35%, Q4_0 +10%); 512 was worse than none, 1024-2048 in between, 8192-16384 equal.
constexpr int64_t kPrefetchDistance = 4096;
static inline void prefetch_ahead(const uint8_t* p, int lines) {
  const uint8_t* q = p + kPrefetchDistance;
  for (int i = 0; i < lines; ++i) __builtin_prefetch(q + 64 * i, 0, 3);
}

static inline float fp16_to_fp32(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
#ifdef __F16C__
  return _cvtsh_ss(h);
#else
  const uint32_t sign = (uint32_t)(h & 0x8000) << 16;
  uint32_t exp = (h >> 10) & 0x1F, man = h & 0x3FF, bits;
  if (exp == 0x1F) {
    bits = sign | 0x7F800000u | (man << 13);
  } else if (exp == 0) {
    if (man == 0) {
      bits = sign;
    } else {  // subnormal: normalize
      int e = -1;
      do { ++e; man <<= 1; } while (!(man & 0x400));
      bits = sign | ((uint32_t)(127 - 15 - e) << 23) | ((man & 0x3FF) << 13);
    }
  } else {
    bits = sign | ((exp + 127 - 15) << 23) | (man << 13);
  }
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
#endif
}

static inline uint32_t load_u32(const uint8_t* p) {
  uint32_t v;
  std::memcpy(&v, p, 4);
  return v;
}

// The 8 six-bit scales and 8 six-bit mins of a Q4_K / Q5_K super-block (12 packed bytes).
static inline void unpack_k4_scales(const uint8_t* s, uint8_t sc[8], uint8_t mn[8]) {
  const uint32_t a = load_u32(s), b = load_u32(s + 4), c = load_u32(s + 8);
  const uint32_t sc_lo = a & 0x3F3F3F3Fu, mn_lo = b & 0x3F3F3F3Fu;
  const uint32_t sc_hi = (c & 0x0F0F0F0Fu) | ((a >> 2) & 0x30303030u);
  const uint32_t mn_hi = ((c >> 4) & 0x0F0F0F0Fu) | ((b >> 2) & 0x30303030u);
  std::memcpy(sc, &sc_lo, 4);
  std::memcpy(sc + 4, &sc_hi, 4);
  std::memcpy(mn, &mn_lo, 4);
  std::memcpy(mn + 4, &mn_hi, 4);
}

#ifdef __AVX2__
static inline float hsum(__m256 v);

// The fp32 accumulators of T tokens: A independent chains per token, so that the 4-cycle FMA
// latency does not bound the loop; at(t, j) takes chain j mod A. A is the same for every T, so a
// row's sum runs in the same order whether a call takes it alone or with up to kMaxT - 1 others:
// its product does not depend on the batch (row invariance, tests/test_quant_kernels.py).
template <int T>
struct Acc {
  static constexpr int A = 2;
  __m256 v[T][A];
  Acc() {
    for (int t = 0; t < T; ++t)
      for (int j = 0; j < A; ++j) v[t][j] = _mm256_setzero_ps();
  }
  inline __m256& at(int t, int j) { return v[t][j % A]; }
  inline float sum(int t) const {
    __m256 s = v[t][0];
    for (int j = 1; j < A; ++j) s = _mm256_add_ps(s, v[t][j]);
    return hsum(s);
  }
};

static inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// VNNI (AVX-VNNI, or AVX-512 VNNI with VL) fuses a multiply-add of integer pairs with the int32
// accumulation: one instruction where AVX2 takes two or three. Integer sums are exact, so the
// results are the same bits either way (the kernels' maddubs never saturates: |w| <= 128 and
// |x| <= 127 give pair sums <= 32512).
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
#define TQ_VNNI 1
static inline __m256i vnni_dpbusd(__m256i acc, __m256i u, __m256i s) { return _mm256_dpbusd_epi32(acc, u, s); }
static inline __m256i vnni_dpwssd(__m256i acc, __m256i a, __m256i b) { return _mm256_dpwssd_epi32(acc, a, b); }
#elif defined(__AVXVNNI__)
#define TQ_VNNI 1
static inline __m256i vnni_dpbusd(__m256i acc, __m256i u, __m256i s) { return _mm256_dpbusd_avx_epi32(acc, u, s); }
static inline __m256i vnni_dpwssd(__m256i acc, __m256i a, __m256i b) { return _mm256_dpwssd_avx_epi32(acc, a, b); }
#endif

// acc + madd_epi16(a, b): int32 lanes += a[2i] b[2i] + a[2i+1] b[2i+1].
static inline __m256i madd_add(__m256i acc, __m256i a, __m256i b) {
#ifdef TQ_VNNI
  return vnni_dpwssd(acc, a, b);
#else
  return _mm256_add_epi32(acc, _mm256_madd_epi16(a, b));
#endif
}

// Sum of u8 x s8 products in groups of 4 -> 8 int32 lanes (lanes 0-3: bytes 0-15, 4-7: 16-31).
static inline __m256i dot_u8s8(__m256i u, __m256i s) {
#ifdef TQ_VNNI
  return vnni_dpbusd(_mm256_setzero_si256(), u, s);
#else
  return _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1));
#endif
}

// 16-bit activations (QAct::q16): a block's 32 codes widened to int16 (w0: the first 16, w1: the
// last 16), and their products with the 32 activations at x by madd_epi16 (|w| <= 128,
// |x| <= 32767: each int32 lane sums 4 products, below 2^24: exact in float).
template <bool Signed>
static inline void widen16(__m256i q, __m256i& w0, __m256i& w1) {
  const __m128i q0 = _mm256_castsi256_si128(q), q1 = _mm256_extracti128_si256(q, 1);
  w0 = Signed ? _mm256_cvtepi8_epi16(q0) : _mm256_cvtepu8_epi16(q0);
  w1 = Signed ? _mm256_cvtepi8_epi16(q1) : _mm256_cvtepu8_epi16(q1);
}

static inline __m256i dot_x16(__m256i w0, __m256i w1, const int16_t* x) {
  const __m256i* v = reinterpret_cast<const __m256i*>(x);
  return madd_add(_mm256_madd_epi16(w0, _mm256_loadu_si256(v)), w1, _mm256_loadu_si256(v + 1));
}

// 32 4-bit values from 16 bytes: low nibbles are elements 0..15, high nibbles 16..31.
// (The 16 bytes are broadcast to both lanes by the load; one variable shift moves the high
// lane's nibbles down.)
static inline __m256i nibbles_lo_hi(const uint8_t* p) {
  const __m256i b = _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm256_and_si256(_mm256_srlv_epi64(b, _mm256_setr_epi64x(0, 0, 4, 4)), _mm256_set1_epi8(0x0F));
}

// Bits 0..31 of the little-endian uint32 at p as 32 bytes of 0xFF (bit set) or 0 (clear).
static inline __m256i bits_to_bytes(const uint8_t* p) {
  const __m256i shuf = _mm256_set_epi64x(0x0303030303030303LL, 0x0202020202020202LL,
                                         0x0101010101010101LL, 0x0000000000000000LL);
  const __m256i all = _mm256_castps_si256(_mm256_broadcast_ss(reinterpret_cast<const float*>(p)));
  const __m256i v = _mm256_shuffle_epi8(all, shuf);
  const __m256i bitmask = _mm256_set1_epi64x(0x8040201008040201LL);
  return _mm256_cmpeq_epi8(_mm256_and_si256(v, bitmask), bitmask);
}

// The same as bytes of 0x10 (bit set) or 0 (clear).
static inline __m256i bits_to_0x10(const uint8_t* p) {
  return _mm256_and_si256(bits_to_bytes(p), _mm256_set1_epi8(0x10));
}

// The 8 scales (bytes 0-7) and 8 mins (bytes 8-15) of a Q4_K / Q5_K super-block from its 12
// packed bytes at p (16 bytes are read: p must have 4 readable bytes past the scales).
static inline __m128i k4_scales_mins(const uint8_t* p) {
  const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  // a = [s0-3 | s8-11 | s4-7 | s8-11], b = [0 | s0-3 | 0 | s4-7]
  const __m128i a = _mm_shuffle_epi8(v, _mm_setr_epi8(0, 1, 2, 3, 8, 9, 10, 11, 4, 5, 6, 7, 8, 9, 10, 11));
  const __m128i b = _mm_shuffle_epi8(v, _mm_setr_epi8(-1, -1, -1, -1, 0, 1, 2, 3, -1, -1, -1, -1, 4, 5, 6, 7));
  const __m128i lo = _mm_and_si128(_mm_srlv_epi32(a, _mm_setr_epi32(0, 0, 0, 4)),
                                   _mm_setr_epi32(0x3F3F3F3F, 0x0F0F0F0F, 0x3F3F3F3F, 0x0F0F0F0F));
  const __m128i hi = _mm_and_si128(_mm_srli_epi32(b, 2), _mm_setr_epi32(0, 0x30303030, 0, 0x30303030));
  return _mm_or_si128(lo, hi);
}

// Dequantization stores: 16 int8 (Signed) or uint8 values v -> 16 floats f(v), where f is one of
// the decoders' fp32 forms (each operation rounded on its own, as in PyTorch).
enum class Aff { Mul, MulSub, MulAdd, SubMul };  // v*a, v*a - c, v*a + c, (v - c)*a

template <Aff A>
static inline __m256 affine(__m256 v, __m256 a, __m256 c) {
  if constexpr (A == Aff::Mul) return _mm256_mul_ps(v, a);
  else if constexpr (A == Aff::MulSub) return _mm256_sub_ps(_mm256_mul_ps(v, a), c);
  else if constexpr (A == Aff::MulAdd) return _mm256_add_ps(_mm256_mul_ps(v, a), c);
  else return _mm256_mul_ps(_mm256_sub_ps(v, c), a);
}

template <Aff A, bool Signed>
static inline void deq16(__m128i q, __m256 a, __m256 c, float* out) {
  const __m128i q2 = _mm_srli_si128(q, 8);
  const __m256i lo = Signed ? _mm256_cvtepi8_epi32(q) : _mm256_cvtepu8_epi32(q);
  const __m256i hi = Signed ? _mm256_cvtepi8_epi32(q2) : _mm256_cvtepu8_epi32(q2);
  _mm256_storeu_ps(out, affine<A>(_mm256_cvtepi32_ps(lo), a, c));
  _mm256_storeu_ps(out + 8, affine<A>(_mm256_cvtepi32_ps(hi), a, c));
}

// 32 values: the first 16 with (a0, c0), the last 16 with (a1, c1).
template <Aff A, bool Signed>
static inline void deq32(__m256i q, __m256 a0, __m256 c0, __m256 a1, __m256 c1, float* out) {
  deq16<A, Signed>(_mm256_castsi256_si128(q), a0, c0, out);
  deq16<A, Signed>(_mm256_extracti128_si256(q, 1), a1, c1, out + 16);
}
template <Aff A, bool Signed>
static inline void deq32(__m256i q, __m256 a, __m256 c, float* out) { deq32<A, Signed>(q, a, c, a, c, out); }
#endif

}  // namespace tq

#include <vector>

namespace tq {

// Portable fallback micro-kernel: decode the weight row with DEQ, then fp32 dots with the
// dequantized activations (d * q, blocks of a.block). Used for builds without AVX2; the AVX2
// kernels must agree.
template <DeqFn DEQ, int T>
void dot_via_deq(const WView& w, int64_t n, const QAct& a, int64_t m0, float* out, int64_t ostride) {
  thread_local std::vector<float> row;
  if ((int64_t)row.size() < w.K) row.resize(w.K);
  DEQ(w, n, row.data());
  for (int t = 0; t < T; ++t) {
    const int8_t* q = a.qrow(m0 + t);
    const float* d = a.drow(m0 + t);
    float acc = 0.f;
    for (int64_t b = 0; b < w.K / a.block; ++b) {
      float s = 0.f;
      for (int64_t i = b * a.block; i < (b + 1) * a.block; ++i) s += row[i] * (float)q[i];
      acc += s * d[b];
    }
    out[t * ostride] = acc;
  }
}

}  // namespace tq
