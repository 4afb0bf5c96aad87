// The store of a quantized K/V format (kv_cache_dtype int8 / int4; layout in kv_quant.h): per
// sequence, the blocks between qlo_old and qlo_new (complete, and now older than its recent window)
// quantized from its ring (positions computed before this step) and this step's new rows — K per
// channel over the block's tokens, V per token, scales rounded to float16 before they divide — then
// its new tokens at qlo_new or later written to its ring in float16.
// Reference: turbollm/attention/kv_quant.py write_reference (tests/test_kv_quant.py holds them together).
#include "ops.h"
#include <ATen/Parallel.h>
#include <algorithm>
#include <cmath>
#include <array>
#include <unordered_set>
#include <vector>

#include "kv_quant.h"

namespace {

float half_round(float x) { return static_cast<float>(at::Half(x)); }

// x [n, D] (stride D) quantized along the n rows for each column (K: per channel) or along the D
// columns for each row (V: per token); writes the integers to q (row stride qstride bytes) and the
// scale (and int4's minimum) of each column / row.
void quantize_run(const float* x, int64_t n, int64_t D, bool per_channel, int64_t bits, uint8_t* q, int64_t qstride,
                  at::Half* scale, at::Half* minimum, int64_t sstride) {
  const int64_t groups = per_channel ? D : n, len = per_channel ? n : D;
  auto at_ = [&](int64_t g, int64_t i) { return per_channel ? x[i * D + g] : x[g * D + i]; };
  for (int64_t g = 0; g < groups; ++g) {
    float lo = INFINITY, hi = -INFINITY, amax = 0.f;
    for (int64_t i = 0; i < len; ++i) {
      const float v = at_(g, i);
      lo = std::min(lo, v);
      hi = std::max(hi, v);
      amax = std::max(amax, std::fabs(v));
    }
    float s, z = 0.f;
    if (bits == 8) {
      s = half_round(amax / 127.f);
    } else {
      z = half_round(lo);
      s = half_round((hi - z) / 15.f);
    }
    scale[g * sstride] = at::Half(s);
    if (bits == 4) minimum[g * sstride] = at::Half(z);
    const float div = s > 0.f ? s : 1.f;
    for (int64_t i = 0; i < len; ++i) {
      const int64_t r = per_channel ? i : g, c = per_channel ? g : i;  // row (token), column (channel)
      if (bits == 8) {
        const float v = std::nearbyint(at_(g, i) / div);
        q[r * qstride + c] = static_cast<uint8_t>(static_cast<int8_t>(std::min(127.f, std::max(-127.f, v))));
      } else {
        const float v = std::min(15.f, std::max(0.f, std::nearbyint((at_(g, i) - z) / div)));
        uint8_t& byte = q[r * qstride + c / 2];
        const uint8_t nib = static_cast<uint8_t>(v);
        byte = (c & 1) ? static_cast<uint8_t>((byte & 0x0F) | (nib << 4)) : static_cast<uint8_t>((byte & 0xF0) | nib);
      }
    }
  }
}

}  // namespace

void paged_write_kv_quant(torch::Tensor k, torch::Tensor v, torch::Tensor kq, torch::Tensor vq, torch::Tensor ks,
                          torch::Tensor vs, torch::Tensor kr, torch::Tensor vr, torch::Tensor block_tables,
                          torch::Tensor query_start_loc, torch::Tensor slots, torch::Tensor first_pos,
                          torch::Tensor qlo_old, torch::Tensor qlo_new, int64_t ring_blocks, int64_t bits) {
  TORCH_CHECK(bits == 8 || bits == 4, "quantized K/V: bits must be 8 or 4");
  TORCH_CHECK(k.dtype() == torch::kFloat32 && v.dtype() == torch::kFloat32 && k.dim() == 3 && k.sizes() == v.sizes(),
              "k and v must be float32 [T, H, D]");
  TORCH_CHECK(k.stride(2) == 1 && k.stride(1) == k.size(2) && v.stride(2) == 1 && v.stride(1) == v.size(2),
              "k and v rows must be contiguous");
  TORCH_CHECK(kq.is_contiguous() && vq.is_contiguous() && ks.is_contiguous() && vs.is_contiguous() &&
                  kr.is_contiguous() && vr.is_contiguous() && ks.dtype() == torch::kFloat16 &&
                  vs.dtype() == torch::kFloat16 && kr.dtype() == torch::kFloat16 && vr.dtype() == torch::kFloat16,
              "quantized K/V: contiguous storage, float16 scales and rings");
  const int64_t H = k.size(1), D = k.size(2), bs = kr.size(1), N = kq.size(0);
  TORCH_CHECK(kr.size(2) == H && kr.size(3) == D && (bits == 8 || D % 2 == 0) && ring_blocks > 0 &&
                  kr.size(0) % ring_blocks == 0, "quantized K/V: shapes do not match");
  auto bt = block_tables.to(torch::kInt64).contiguous();
  auto qsl = query_start_loc.to(torch::kInt64).contiguous();
  auto sl = slots.to(torch::kInt64).contiguous(), fp = first_pos.to(torch::kInt64).contiguous();
  auto lo = qlo_old.to(torch::kInt64).contiguous(), hi = qlo_new.to(torch::kInt64).contiguous();
  const int64_t B = sl.numel(), W = bt.size(1), slots_total = kr.size(0) / ring_blocks;
  TORCH_CHECK(qsl.numel() == B + 1 && fp.numel() == B && lo.numel() == B && hi.numel() == B && bt.size(0) >= B,
              "quantized K/V: one entry per sequence");
  const int64_t* q0 = qsl.data_ptr<int64_t>();
  const int64_t* slotp = sl.data_ptr<int64_t>();
  const int64_t* cp = fp.data_ptr<int64_t>();
  const int64_t* lop = lo.data_ptr<int64_t>();
  const int64_t* hip = hi.data_ptr<int64_t>();
  const int64_t* btp = bt.data_ptr<int64_t>();
  const int64_t rowq = bits == 8 ? D : D / 2;
  for (int64_t b = 0; b < B; ++b) {
    const int64_t n = q0[b + 1] - q0[b];
    TORCH_CHECK(slotp[b] >= 0 && slotp[b] < slots_total && lop[b] % bs == 0 && hip[b] % bs == 0 && lop[b] <= hip[b] &&
                    hip[b] <= cp[b] + n && hip[b] / bs <= W && cp[b] + n - std::max(cp[b], hip[b]) <= ring_blocks * bs,
                "quantized K/V: sequence ", b, " has a bad slot, bound or more recent tokens than its ring");
    for (int64_t j = lop[b] / bs; j < hip[b] / bs; ++j)
      TORCH_CHECK(btp[b * W + j] >= 0 && btp[b * W + j] < N, "quantized K/V: block ", btp[b * W + j], " out of range");
  }
  auto* kqp = static_cast<uint8_t*>(kq.data_ptr());
  auto* vqp = static_cast<uint8_t*>(vq.data_ptr());
  auto* ksp = ks.data_ptr<at::Half>();
  auto* vsp = vs.data_ptr<at::Half>();
  auto* krp = kr.data_ptr<at::Half>();
  auto* vrp = vr.data_ptr<at::Half>();
  const float* kp = k.data_ptr<float>();
  const float* vp = v.data_ptr<float>();
  const int64_t kst = k.stride(0), vst = v.stride(0);
  auto ring_row = [&](int64_t slot, int64_t p, int64_t h) { return (((slot * ring_blocks + (p / bs) % ring_blocks) * bs + p % bs) * H + h) * D; };
  // 1. quantize: jobs (sequence, block, head)
  // (n > 1 siblings may share a block not yet quantized: it is quantized once, by the first of them)
  std::vector<std::array<int64_t, 3>> jobs;
  std::unordered_set<int64_t> seen;
  for (int64_t b = 0; b < B; ++b)
    for (int64_t j = lop[b] / bs; j < hip[b] / bs; ++j)
      if (seen.insert(btp[b * W + j]).second)
        for (int64_t h = 0; h < H; ++h) jobs.push_back({b, j, h});
  at::parallel_for(0, (int64_t)jobs.size(), 1, [&](int64_t begin, int64_t end) {
    std::vector<float> kx(bs * D), vx(bs * D);
    for (int64_t job = begin; job < end; ++job) {
      const int64_t b = jobs[job][0], j = jobs[job][1], h = jobs[job][2], c = cp[b];
      for (int64_t t = 0; t < bs; ++t) {
        const int64_t p = j * bs + t;
        if (p < c) {
          const int64_t r = ring_row(slotp[b], p, h);
          for (int64_t d = 0; d < D; ++d) {
            kx[t * D + d] = static_cast<float>(krp[r + d]);
            vx[t * D + d] = static_cast<float>(vrp[r + d]);
          }
        } else {
          const float* ks_ = kp + (q0[b] + p - c) * kst + h * D;
          const float* vs_ = vp + (q0[b] + p - c) * vst + h * D;
          std::copy(ks_, ks_ + D, kx.data() + t * D);
          std::copy(vs_, vs_ + D, vx.data() + t * D);
        }
      }
      const int64_t blk = btp[b * W + j];
      uint8_t* kdst = kqp + (blk * bs * H + h) * rowq;  // row t at + t * H * rowq
      uint8_t* vdst = vqp + (blk * bs * H + h) * rowq;
      if (bits == 8) {
        quantize_run(kx.data(), bs, D, true, 8, kdst, H * rowq, ksp + (blk * H + h) * D, nullptr, 1);
        quantize_run(vx.data(), bs, D, false, 8, vdst, H * rowq, vsp + blk * bs * H + h, nullptr, H);
      } else {
        quantize_run(kx.data(), bs, D, true, 4, kdst, H * rowq, ksp + (blk * 2 * H + h) * D,
                     ksp + ((blk * 2 + 1) * H + h) * D, 1);
        quantize_run(vx.data(), bs, D, false, 4, vdst, H * rowq, vsp + (blk * bs * H + h) * 2,
                     vsp + (blk * bs * H + h) * 2 + 1, 2 * H);
      }
    }
  });
  // 2. the new tokens still in the recent window, to the ring in float16
  for (int64_t b = 0; b < B; ++b) {
    const int64_t c = cp[b], n = q0[b + 1] - q0[b];
    for (int64_t p = std::max(c, hip[b]); p < c + n; ++p)
      for (int64_t h = 0; h < H; ++h) {
        const int64_t r = ring_row(slotp[b], p, h);
        const float* ks_ = kp + (q0[b] + p - c) * kst + h * D;
        const float* vs_ = vp + (q0[b] + p - c) * vst + h * D;
        for (int64_t d = 0; d < D; ++d) {
          krp[r + d] = at::Half(ks_[d]);
          vrp[r + d] = at::Half(vs_[d]);
        }
      }
  }
}
