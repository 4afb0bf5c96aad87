// Python bindings of the turbollm_kernels extension: decode attention, fused element-wise ops,
// quantized matmuls (declared in ops.h) and the fused decode step (decode_step.cpp).
#include "ops.h"

void bind_decode_step(pybind11::module_& m);
void shm_exchange(torch::Tensor t, torch::Tensor buf, torch::Tensor flags, int64_t rank, int64_t seq, double timeout_s);
void copy_kv_blocks(const std::vector<torch::Tensor>& srcs, const std::vector<torch::Tensor>& dsts,
                    torch::Tensor src_idx, torch::Tensor dst_idx);

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  // Tensors in, tensors out: the kernels let go of Python's lock, so other threads of the process run
  // meanwhile (a torchrun rank's heartbeat, engine/executor/heartbeat.py; the server's event loop).
  const auto nogil = pybind11::call_guard<pybind11::gil_scoped_release>();
  m.def("paged_decode_attention", &paged_decode_attention, "decode attention over a paged KV cache (CPU); with "
        "query_start_loc, each of a sequence's few new tokens attended as a decode of its own position",
        pybind11::arg("q"), pybind11::arg("k_cache"), pybind11::arg("v_cache"), pybind11::arg("block_tables"),
        pybind11::arg("seq_lens"), pybind11::arg("scale"), pybind11::arg("window"), pybind11::arg("softcap"),
        pybind11::arg("query_start_loc") = pybind11::none(), pybind11::arg("sinks") = 0,
        pybind11::arg("q_sink") = pybind11::none(), nogil);
  m.attr("small_query_max") = kSmallQueryMax;
  m.def("paged_attention", &paged_attention, "attention over a paged KV cache for any number of new tokens per "
        "sequence (tiled over keys, online softmax)", pybind11::arg("q"), pybind11::arg("k_cache"),
        pybind11::arg("v_cache"), pybind11::arg("block_tables"), pybind11::arg("query_start_loc"),
        pybind11::arg("seq_lens"), pybind11::arg("scale"), pybind11::arg("window"), pybind11::arg("softcap"),
        pybind11::arg("sinks") = 0, pybind11::arg("q_sink") = pybind11::none(), nogil);
  m.def("set_attention_isa", &set_attention_isa, "the form of paged_attention's key step: 'auto' (the widest this CPU "
        "runs), 'portable', 'avx2' or 'avx512', the same bits in each; returns the form before");
  m.def("paged_key_mass", &paged_key_mass, "add each table entry's attention mass (softmax over heads and the rows "
        "from first_rows) into out [B, width] (attention-score eviction)", nogil);
  m.def("paged_write_kv", &paged_write_kv, "store the new tokens' K and V rows at their cache slots", nogil);
  m.def("paged_write_kv_quant", &paged_write_kv_quant, "quantized K/V: quantize the blocks leaving the recent "
        "window, store the newest tokens in the sequences' float16 rings", nogil);
  m.def("paged_decode_attention_quant", &paged_decode_attention_quant, "decode attention over quantized K/V",
        pybind11::arg("q"), pybind11::arg("kv"), pybind11::arg("block_tables"), pybind11::arg("seq_lens"),
        pybind11::arg("slots"), pybind11::arg("qlo"), pybind11::arg("ring_blocks"), pybind11::arg("bits"),
        pybind11::arg("scale"), pybind11::arg("window"), pybind11::arg("softcap"),
        pybind11::arg("query_start_loc") = pybind11::none(), nogil);
  m.def("paged_attention_quant", &paged_attention_quant, "tiled attention over quantized K/V", nogil);
  m.def("rms_norm", &rms_norm, "RMSNorm of the rows of x, optionally after residual += x (in place)",
        pybind11::arg("x"), pybind11::arg("w"), pybind11::arg("eps"), pybind11::arg("residual") = pybind11::none(),
        nogil);
  m.def("rope_", &rope_, "NeoX rotary embedding in place on q and k", nogil);
  m.def("gated_act", &gated_act, "act(gate) * up of a merged [T, 2I] projection (0 = SiLU, 1 = GELU tanh)", nogil);

  m.def("quantize_act", &quantize_act, "x [M, K] -> quantized activations in blocks of 32 or 256", nogil);
  m.def("act_block", &act_block, "activation block size (32 or 256) of a type's dot kernels");
  m.def("linear_q8", &linear_q8, "x @ W.T with int8 activations (levels 1 or 2) or int16 ones (16), integer dot "
        "products", nogil);
  m.def("linear_dequant", &linear_dequant, "x @ W.T by row chunks: dequantize to fp32, then mm", nogil);
  m.def("dequant", &dequant, "all rows of a weight as float32 [N, K]", nogil);
  m.def("embedding", &embedding, "rows ids of a weight table as float32 [len(ids), K]", nogil);
  m.def("supported", &supported, "whether a type has kernels");
  m.def("supported16", &supported16, "whether a type has 16-bit activation (q16) kernels");
  m.def("kernel_forms", &kernel_forms, "the kernel forms this build runs on this CPU, best last");
  m.def("repackable", &repackable, "whether GGML type `qtype` has the repacked type base + qtype (2000: avx512_vnni, "
        "3000: amx, 4000: avx2_tiles) with kernels this CPU runs", pybind11::arg("qtype"), pybind11::arg("base") = 2000);
  m.def("repack", &repack, "a GGML weight [N, row_bytes] in its interleaved layout (type id + 2000)", nogil);
  m.def("unrepack", &unrepack, "a repacked weight back in its GGML layout", nogil);
  m.attr("repacked_base") = 2000;
  m.attr("repacked_amx_base") = 3000;
  m.attr("repacked_avx2_base") = 4000;
  m.def("peak_gops", &peak_gops, "G ops/s of one instruction form's register-only multiply-add loop on `threads` "
        "threads (int8_vnni512, int8_avx2, bf16_avx512, fp32_avx512, fp32_avx2, int8_amx; 0: not on this CPU)", nogil);

  m.def("dense_linear", &dense_linear, "float32 x @ W.T (+ bias), W float32 or bfloat16: a pass over W for up to 4 rows of x at a time "
        "(up to 16 rows; more go to at::linear, in bfloat16 for a bfloat16 W)", pybind11::arg("x"), pybind11::arg("w"),
        pybind11::arg("bias") = pybind11::none(), nogil);
  m.attr("dense_max_rows") = kDenseMaxRows;
  m.def("dense_linear_form", &dense_linear_form, "dense_linear with its pass in form 'avx2' or 'avx512' (the same "
        "bits; dense_linear takes AVX-512 where the CPU has it)", pybind11::arg("x"), pybind11::arg("w"),
        pybind11::arg("bias") = pybind11::none(), pybind11::arg("form") = "avx2", nogil);
  m.def("scaled_row_max", &scaled_row_max, "out[k, i] = max_j absw[i, j] * cands[k, j] (int8 equalization search)",
        nogil);

  m.def("copy_kv_blocks", &copy_kv_blocks, "block dst_idx[i] of each dsts[p] := block src_idx[i] of srcs[p] (uint8 "
        "[blocks, bytes] views; one memcpy per block and part)", nogil);
  m.def("shm_exchange", &shm_exchange, "publish t in this rank's shared-memory slot of exchange seq and wait for "
        "every rank's (tensor parallelism on one host)", nogil);
  bind_decode_step(m);
}
