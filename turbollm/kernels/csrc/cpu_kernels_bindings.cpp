// Python bindings of the turbollm_cpu_kernels extension (attention and fused element-wise ops).
#include <torch/extension.h>

torch::Tensor paged_decode_attention(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                                     torch::Tensor block_tables, torch::Tensor seq_lens, double scale,
                                     int64_t window, double softcap);
void paged_write_kv(torch::Tensor k, torch::Tensor v, torch::Tensor k_cache, torch::Tensor v_cache,
                    torch::Tensor slot_mapping);
torch::Tensor rms_norm(torch::Tensor x, torch::Tensor w, double eps, c10::optional<torch::Tensor> residual);
void rope_(torch::Tensor q, torch::Tensor k, torch::Tensor positions, torch::Tensor cos, torch::Tensor sin);
torch::Tensor gated_act(torch::Tensor gate_up, int64_t act);

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode_attention", &paged_decode_attention, "decode attention over a paged KV cache (CPU)");
  m.def("paged_write_kv", &paged_write_kv, "store the new tokens' K and V rows at their cache slots");
  m.def("rms_norm", &rms_norm, "RMSNorm of the rows of x, optionally after residual += x (in place)",
        pybind11::arg("x"), pybind11::arg("w"), pybind11::arg("eps"), pybind11::arg("residual") = pybind11::none());
  m.def("rope_", &rope_, "NeoX rotary embedding in place on q and k");
  m.def("gated_act", &gated_act, "act(gate) * up of a merged [T, 2I] projection (0 = SiLU, 1 = GELU tanh)");
}
