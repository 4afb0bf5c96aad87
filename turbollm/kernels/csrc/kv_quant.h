// Quantized paged K/V (kv_cache_dtype int8 / int4): the layout the attention kernels read, and the
// row loader that dequantizes a run of positions into float rows. Layout (attention/kv_storage.py):
// pool blocks [N, bs, H, D] int8 (int4: [N, bs, H, D/2], two values a byte, even channel in the low
// nibble); K scales per channel per block [N, H, D] float16 (int4: [N, 2, H, D], scale then minimum),
// V scales per token [N, bs, H] (int4: [N, bs, H, 2]); each sequence's newest tokens in float16 in its
// ring [slots * m, bs, H, D] (block j of a sequence in ring block slot * m + j % m). Positions below a
// sequence's `qlo` are in the pool, the rest in its ring.
// Reference: turbollm/attention/kv_quant.py (tests/test_kv_quant.py holds them together).
#pragma once
#include <torch/extension.h>
#include <ATen/ATen.h>
#include <cstdint>
#include <cstring>

#ifdef __AVX2__
#include <immintrin.h>
#endif

struct QuantKV {
  int64_t bits = 0;  // 8 or 4 (0: not quantized)
  const uint8_t* kq = nullptr;
  const uint8_t* vq = nullptr;
  const at::Half* ks = nullptr;
  const at::Half* vs = nullptr;
  const at::Half* kr = nullptr;  // rings
  const at::Half* vr = nullptr;
  int64_t bs = 0, H = 0, D = 0, m = 0;  // block size, KV heads, head dim, ring blocks per slot
  const int64_t* slot = nullptr;  // per sequence
  const int64_t* qlo = nullptr;   // per sequence
};

// out[0:8) = float(q[0:8]) * s + z (int8: z = 0)
#ifdef __AVX2__
static inline __m256 int8x8(const int8_t* q) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(q))));
}
// eight 4-bit values from four bytes (low nibble first)
static inline __m256 int4x8(const uint8_t* q) {
  int32_t word;
  std::memcpy(&word, q, 4);
  const __m128i bytes = _mm_shuffle_epi8(_mm_cvtsi32_si128(word), _mm_setr_epi8(0, 0, 1, 1, 2, 2, 3, 3, -1, -1, -1,
                                                                                 -1, -1, -1, -1, -1));
  const __m256i wide = _mm256_cvtepu8_epi32(bytes);
  const __m256i nib = _mm256_and_si256(_mm256_srlv_epi32(wide, _mm256_setr_epi32(0, 4, 0, 4, 0, 4, 0, 4)),
                                       _mm256_set1_epi32(15));
  return _mm256_cvtepi32_ps(nib);
}
static inline __m256 half8(const at::Half* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
#endif

static inline float int4_at(const uint8_t* q, int64_t d) { return static_cast<float>((q[d >> 1] >> ((d & 1) * 4)) & 15); }

// K and V of head h at positions [t0, t1) of a sequence (block table `table`, its qlo and ring slot)
// as float rows kb[(t - t0) * D ..], vb[...].
static inline void load_quant_rows(const QuantKV& s, const int64_t* table, int64_t qlo, int64_t slot, int64_t h,
                                   int64_t t0, int64_t t1, float* kb, float* vb) {
  const int64_t bs = s.bs, H = s.H, D = s.D;
  const int64_t rowq = s.bits == 8 ? D : D / 2;  // bytes of one quantized row
  for (int64_t t = t0; t < t1; ++t) {
    float* ko = kb + (t - t0) * D;
    float* vo = vb + (t - t0) * D;
    const int64_t j = t % bs;
    if (t >= qlo) {  // the ring: float16
      const int64_t off = (((slot * s.m + (t / bs) % s.m) * bs + j) * H + h) * D;
      int64_t d = 0;
#ifdef __AVX2__
      for (; d + 8 <= D; d += 8) {
        _mm256_storeu_ps(ko + d, half8(s.kr + off + d));
        _mm256_storeu_ps(vo + d, half8(s.vr + off + d));
      }
#endif
      for (; d < D; ++d) { ko[d] = static_cast<float>(s.kr[off + d]); vo[d] = static_cast<float>(s.vr[off + d]); }
      continue;
    }
    const int64_t blk = table[t / bs];
    const uint8_t* kq = s.kq + ((blk * bs + j) * H + h) * rowq;
    const uint8_t* vq = s.vq + ((blk * bs + j) * H + h) * rowq;
    if (s.bits == 8) {
      const at::Half* ksc = s.ks + (blk * H + h) * D;
      const float vsc = static_cast<float>(s.vs[(blk * bs + j) * H + h]);
      int64_t d = 0;
#ifdef __AVX2__
      const __m256 vv = _mm256_set1_ps(vsc);
      for (; d + 8 <= D; d += 8) {
        _mm256_storeu_ps(ko + d, _mm256_mul_ps(int8x8(reinterpret_cast<const int8_t*>(kq) + d), half8(ksc + d)));
        _mm256_storeu_ps(vo + d, _mm256_mul_ps(int8x8(reinterpret_cast<const int8_t*>(vq) + d), vv));
      }
#endif
      for (; d < D; ++d) {
        ko[d] = static_cast<float>(static_cast<int8_t>(kq[d])) * static_cast<float>(ksc[d]);
        vo[d] = static_cast<float>(static_cast<int8_t>(vq[d])) * vsc;
      }
    } else {
      const at::Half* ksc = s.ks + ((blk * 2) * H + h) * D;
      const at::Half* kmn = s.ks + ((blk * 2 + 1) * H + h) * D;
      const at::Half* vp = s.vs + ((blk * bs + j) * H + h) * 2;
      const float vsc = static_cast<float>(vp[0]), vmn = static_cast<float>(vp[1]);
      int64_t d = 0;
#ifdef __AVX2__
      const __m256 vv = _mm256_set1_ps(vsc), vz = _mm256_set1_ps(vmn);
      for (; d + 8 <= D; d += 8) {
        _mm256_storeu_ps(ko + d, _mm256_fmadd_ps(int4x8(kq + d / 2), half8(ksc + d), half8(kmn + d)));
        _mm256_storeu_ps(vo + d, _mm256_fmadd_ps(int4x8(vq + d / 2), vv, vz));
      }
#endif
      for (; d < D; ++d) {
        ko[d] = int4_at(kq, d) * static_cast<float>(ksc[d]) + static_cast<float>(kmn[d]);
        vo[d] = int4_at(vq, d) * vsc + vmn;
      }
    }
  }
}

// The kernels' view of a layer's quantized storage: kv = {kq, vq, k_scale, v_scale, k_ring, v_ring} with
// per-sequence slots and qlo (int64, contiguous, kept alive by the caller).
static inline QuantKV make_quant_kv(const std::vector<torch::Tensor>& kv, int64_t ring_blocks, int64_t bits,
                                    int64_t D, const torch::Tensor& slots, const torch::Tensor& qlo, int64_t B) {
  TORCH_CHECK(kv.size() == 6, "quantized K/V: kq, vq, k_scale, v_scale, k_ring, v_ring");
  TORCH_CHECK(bits == 8 || bits == 4, "quantized K/V: bits must be 8 or 4");
  for (int i = 0; i < 6; ++i) TORCH_CHECK(kv[i].is_contiguous(), "quantized K/V: contiguous storage");
  TORCH_CHECK(kv[2].dtype() == torch::kFloat16 && kv[3].dtype() == torch::kFloat16 && kv[4].dtype() == torch::kFloat16 &&
                  kv[5].dtype() == torch::kFloat16, "quantized K/V: float16 scales and rings");
  TORCH_CHECK(kv[4].size(3) == D && ring_blocks > 0 && kv[4].size(0) % ring_blocks == 0 &&
                  kv[0].size(3) == (bits == 8 ? D : D / 2), "quantized K/V: shapes do not match");
  TORCH_CHECK(slots.numel() >= B && qlo.numel() >= B, "quantized K/V: a slot and a bound per sequence");
  const int64_t nslots = kv[4].size(0) / ring_blocks;
  for (int64_t b = 0; b < B; ++b)
    TORCH_CHECK(slots.data_ptr<int64_t>()[b] >= 0 && slots.data_ptr<int64_t>()[b] < nslots,
                "quantized K/V: ring slot out of range");
  QuantKV s;
  s.bits = bits;
  s.kq = static_cast<const uint8_t*>(kv[0].data_ptr());
  s.vq = static_cast<const uint8_t*>(kv[1].data_ptr());
  s.ks = kv[2].data_ptr<at::Half>();
  s.vs = kv[3].data_ptr<at::Half>();
  s.kr = kv[4].data_ptr<at::Half>();
  s.vr = kv[5].data_ptr<at::Half>();
  s.bs = kv[4].size(1);
  s.H = kv[4].size(2);
  s.D = D;
  s.m = ring_blocks;
  s.slot = slots.data_ptr<int64_t>();
  s.qlo = qlo.data_ptr<int64_t>();
  return s;
}
