// The torch-level entry points of the turbollm_kernels extension, shared by the Python bindings
// (bindings.cpp) and the fused decode step (decode_step.cpp), which calls them without Python.
//
// fused_ops.cpp: rms_norm, rope_, gated_act; paged_attention.cpp: paged_decode_attention,
// paged_write_kv; flash_attention.cpp: paged_attention (any number of new tokens per sequence);
// dense_gemv.cpp: dense_linear (float32 decode rows); quant_ops.cpp: the
// quantized matmuls (weight formats in quant_ops.cpp's header comment; their PyTorch references in
// turbollm/kernels/quant.py); scaled_row_max.cpp: the int8 equalization search's row maxima.
#pragma once
#include <torch/extension.h>

#include <vector>

// Steps where every sequence brings at most this many new tokens are "small-query" steps: their
// attention runs through paged_decode_attention with query_start_loc (one decode per new token),
// so that each row's output is the one it has alone (row invariance); longer ones take the tiled
// paged_attention.
constexpr int64_t kSmallQueryMax = 8;
torch::Tensor paged_decode_attention(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                                     torch::Tensor block_tables, torch::Tensor seq_lens, double scale,
                                     int64_t window, double softcap, c10::optional<torch::Tensor> query_start_loc,
                                     int64_t sinks = 0, c10::optional<torch::Tensor> q_sink = c10::nullopt);
// key_mass.cpp: the attention mass each block-table entry gets (attention-score eviction)
void paged_key_mass(torch::Tensor q, torch::Tensor k_cache, torch::Tensor block_tables, torch::Tensor query_start_loc,
                    torch::Tensor seq_lens, torch::Tensor first_rows, double scale, double softcap, torch::Tensor out);
void paged_write_kv(torch::Tensor k, torch::Tensor v, torch::Tensor k_cache, torch::Tensor v_cache,
                    torch::Tensor slot_mapping);
torch::Tensor paged_attention(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                              torch::Tensor block_tables, torch::Tensor query_start_loc, torch::Tensor seq_lens,
                              double scale, int64_t window, double softcap, int64_t sinks = 0,
                              c10::optional<torch::Tensor> q_sink = c10::nullopt);
// The form of paged_attention's key step, "auto" (the widest this CPU runs), "portable", "avx2" or "avx512":
// the same bits in each (attention_tile.h); returns the form before. For tests and benchmarks.
std::string set_attention_isa(const std::string& isa);
torch::Tensor rms_norm(torch::Tensor x, torch::Tensor w, double eps, c10::optional<torch::Tensor> residual);
void rope_(torch::Tensor q, torch::Tensor k, torch::Tensor positions, torch::Tensor cos, torch::Tensor sin);
torch::Tensor gated_act(torch::Tensor gate_up, int64_t act);

std::vector<torch::Tensor> quantize_act(torch::Tensor x, int64_t block, int64_t levels);
torch::Tensor linear_q8(torch::Tensor x, torch::Tensor w, int64_t qtype, int64_t K,
                        c10::optional<torch::Tensor> scale, c10::optional<torch::Tensor> zero, int64_t group,
                        c10::optional<torch::Tensor> out, int64_t levels);
torch::Tensor linear_dequant(torch::Tensor x, torch::Tensor w, int64_t qtype, int64_t K,
                             c10::optional<torch::Tensor> scale, c10::optional<torch::Tensor> zero, int64_t group,
                             c10::optional<torch::Tensor> out, int64_t chunk_rows);
torch::Tensor dequant(torch::Tensor w, int64_t qtype, int64_t K, c10::optional<torch::Tensor> scale,
                      c10::optional<torch::Tensor> zero, int64_t group, c10::optional<torch::Tensor> out);
torch::Tensor embedding(torch::Tensor w, int64_t qtype, int64_t K, torch::Tensor ids);
int64_t act_block(int64_t qtype);
bool supported(int64_t qtype);
bool supported16(int64_t qtype);
// the kernel forms this build and CPU run ("avx2", "avx512_vnni"); repacked layouts (repacked.h)
std::vector<std::string> kernel_forms();
bool repackable(int64_t qtype, int64_t base);
torch::Tensor repack(torch::Tensor w, int64_t qtype, int64_t K);
torch::Tensor unrepack(torch::Tensor w, int64_t qtype, int64_t K);
double peak_gops(const std::string& name, int64_t threads, double seconds);

torch::Tensor scaled_row_max(torch::Tensor absw, torch::Tensor cands);
// rows of x up to which dense_linear takes its own kernel (beyond, at::linear does the product):
// the 16 rows of a batch-16 decode, within which a row's result does not depend on the others
constexpr int64_t kDenseMaxRows = 16;
torch::Tensor dense_linear(torch::Tensor x, torch::Tensor w, c10::optional<torch::Tensor> bias);
// the same with the pass's form named ("avx2", "avx512": the same bits; dense_linear takes the CPU's best)
torch::Tensor dense_linear_form(torch::Tensor x, torch::Tensor w, c10::optional<torch::Tensor> bias,
                                const std::string& form);

// kv_quant.cpp / paged_attention.cpp / flash_attention.cpp: quantized K/V (int8 / int4 blocks with
// float16 scales, each sequence's newest tokens in a float16 ring; layout in kv_quant.h)
void paged_write_kv_quant(torch::Tensor k, torch::Tensor v, torch::Tensor kq, torch::Tensor vq, torch::Tensor ks,
                          torch::Tensor vs, torch::Tensor kr, torch::Tensor vr, torch::Tensor block_tables,
                          torch::Tensor query_start_loc, torch::Tensor slots, torch::Tensor first_pos,
                          torch::Tensor qlo_old, torch::Tensor qlo_new, int64_t ring_blocks, int64_t bits);
torch::Tensor paged_decode_attention_quant(torch::Tensor q, std::vector<torch::Tensor> kv, torch::Tensor block_tables,
                                           torch::Tensor seq_lens, torch::Tensor slots, torch::Tensor qlo,
                                           int64_t ring_blocks, int64_t bits, double scale, int64_t window,
                                           double softcap, c10::optional<torch::Tensor> query_start_loc);
torch::Tensor paged_attention_quant(torch::Tensor q, std::vector<torch::Tensor> kv, torch::Tensor block_tables,
                                    torch::Tensor query_start_loc, torch::Tensor seq_lens, torch::Tensor slots,
                                    torch::Tensor qlo, int64_t ring_blocks, int64_t bits, double scale,
                                    int64_t window, double softcap);
