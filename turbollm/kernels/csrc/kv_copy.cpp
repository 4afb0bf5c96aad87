// Block copies between K/V pools (turbollm/kv_transfer/block_copy.py): block dst_idx[i] of every dsts[p] becomes a
// copy of block src_idx[i] of srcs[p]. Each tensor is one contiguous [blocks, bytes] byte view of a layer part
// (K, V, or a quantized format's scales); srcs[p] and dsts[p] have the same bytes per block. One memcpy per block
// and part, spread over the threads: torch's index_copy_ moves a block element by element (measured ~20x slower
// on 4 KiB blocks), and a gather into a buffer then a scatter moves every byte twice. The source may be another
// process's pool mapped read-only (a prefill instance's, worker/kv_connector.py).
#include <torch/extension.h>

#include <ATen/Parallel.h>

#include <cstring>
#include <vector>

void copy_kv_blocks(const std::vector<torch::Tensor>& srcs, const std::vector<torch::Tensor>& dsts,
                    torch::Tensor src_idx, torch::Tensor dst_idx) {
  TORCH_CHECK(srcs.size() == dsts.size(), "copy_kv_blocks: ", srcs.size(), " sources for ", dsts.size(), " targets");
  TORCH_CHECK(src_idx.dtype() == torch::kInt64 && dst_idx.dtype() == torch::kInt64 && src_idx.dim() == 1 &&
                  src_idx.numel() == dst_idx.numel() && src_idx.is_contiguous() && dst_idx.is_contiguous(),
              "copy_kv_blocks: src_idx and dst_idx must be int64 vectors of one length");
  const int64_t n = src_idx.numel(), parts = (int64_t)srcs.size();
  const int64_t* si = src_idx.data_ptr<int64_t>();
  const int64_t* di = dst_idx.data_ptr<int64_t>();
  std::vector<const uint8_t*> sp(parts);
  std::vector<uint8_t*> dp(parts);
  std::vector<int64_t> bytes(parts);
  for (int64_t p = 0; p < parts; ++p) {
    const auto& s = srcs[p];
    const auto& d = dsts[p];
    TORCH_CHECK(s.dtype() == torch::kUInt8 && d.dtype() == torch::kUInt8 && s.dim() == 2 && d.dim() == 2 &&
                    s.is_contiguous() && d.is_contiguous() && s.size(1) == d.size(1),
                "copy_kv_blocks: part ", p, " must be contiguous uint8 [blocks, bytes] views of equal block bytes");
    for (int64_t i = 0; i < n; ++i)
      TORCH_CHECK(0 <= si[i] && si[i] < s.size(0) && 0 <= di[i] && di[i] < d.size(0), "copy_kv_blocks: block ",
                  si[i], " -> ", di[i], " outside part ", p, " (", s.size(0), " -> ", d.size(0), " blocks)");
    sp[p] = s.data_ptr<uint8_t>();
    dp[p] = d.data_ptr<uint8_t>();
    bytes[p] = s.size(1);
  }
  // one task = one block of one part, parts outermost (each part's blocks are consecutive in the schedule)
  at::parallel_for(0, parts * n, 16, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const int64_t p = t / n, i = t % n, b = bytes[p];
      std::memcpy(dp[p] + di[i] * b, sp[p] + si[i] * b, b);
    }
  });
}
