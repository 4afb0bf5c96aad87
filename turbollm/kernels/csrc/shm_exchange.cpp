// Shared-memory exchange between the tensor-parallel ranks of one host (turbollm/distributed/shm_comm.py).
//
// `buf` is float32 [2, world, chunk] and `flags` int64 [world, 8] (one 64-byte line per rank), both in
// one shared mapping every rank opened. Exchange number `seq` (1, 2, ...): the rank copies its `n`
// values into slot [seq % 2][rank], publishes `seq` in its flag (release), and waits until every
// rank's flag is at least `seq` (acquire); the caller then reads all slots of [seq % 2] (a sum for an
// all-reduce, a concatenation for an all-gather). Two alternating buffers make that safe without a
// second barrier: a rank writes buffer seq % 2 again only at seq + 2, after every rank has published
// seq + 1, which each does only after reading exchange seq. A rank that does not arrive within
// `timeout_s` (dead or hung) makes the others raise, naming it.
#include <torch/extension.h>

#include <chrono>
#include <cstring>
#include <thread>
#ifdef __x86_64__
#include <immintrin.h>
#endif

void shm_exchange(torch::Tensor t, torch::Tensor buf, torch::Tensor flags, int64_t rank, int64_t seq,
                  double timeout_s) {
  TORCH_CHECK(t.dtype() == torch::kFloat32 && t.is_contiguous(), "shm exchange: t must be contiguous float32");
  TORCH_CHECK(buf.dtype() == torch::kFloat32 && buf.dim() == 3 && buf.size(0) == 2 && buf.is_contiguous(),
              "shm exchange: buf must be float32 [2, world, chunk]");
  TORCH_CHECK(flags.dtype() == torch::kInt64 && flags.dim() == 2 && flags.size(1) == 8, "shm exchange: flags [world, 8]");
  const int64_t world = buf.size(1), chunk = buf.size(2), n = t.numel();
  TORCH_CHECK(0 <= rank && rank < world && flags.size(0) == world && n <= chunk && seq > 0, "shm exchange: bad call");
  float* slot = buf.data_ptr<float>() + ((seq % 2) * world + rank) * chunk;
  std::memcpy(slot, t.data_ptr<float>(), n * sizeof(float));
  int64_t* f = flags.data_ptr<int64_t>();
  __atomic_store_n(&f[rank * 8], seq, __ATOMIC_RELEASE);
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::duration<double>(timeout_s);
  for (int64_t r = 0; r < world; ++r) {
    int64_t spins = 0;
    while (__atomic_load_n(&f[r * 8], __ATOMIC_ACQUIRE) < seq) {
      if (++spins < 4096) {
#ifdef __x86_64__
        _mm_pause();
#endif
        continue;
      }
      spins = 0;
      std::this_thread::yield();  // a rank sharing this core gets to run
      if (std::chrono::steady_clock::now() > deadline)
        TORCH_CHECK(false, "shared-memory exchange ", seq, ": rank ", r, " did not arrive within ", timeout_s,
                    " s (dead or hung)");
    }
  }
}
