// The fused step: every decoder layer of a llama-family or gemma3 model, for a batch of decodes or
// of a few new tokens per sequence, in one call from Python.
//
// A decode step of a small model is hundreds of short kernels; between them the Python module
// path spends ~150 us per layer (smollm2-135m) in module calls, argument parsing and dispatch.
// This object holds, per layer, the tensors and constants those calls would pass and runs the
// same kernels (ops.h) on the same tensors in the same order, so its result is bit-identical to
// the module path (tests/test_fused_step.py); only the interpreter between them is gone.
// turbollm/worker/fused_step.py (the model runner's) builds it from a loaded model and its KV
// storage, and decides which steps take it.
#include "ops.h"

namespace py = pybind11;

namespace {

constexpr int64_t kDense = -1;  // a float32 part, multiplied by dense_linear (as the module path)

// A linear layer as its method applies it: parts of output rows (GGML types, the integer layouts
// with their scales / zero points / group, or dense float32), concatenated, then the bias added in
// place; or one dense part with the bias inside dense_linear. With `perm` (GPTQ act-order) the
// input columns are gathered first, as the int4 method's apply does.
struct Linear {
  std::vector<int64_t> qtypes;
  std::vector<bool> has16;  // per part: the type has 16-bit activation kernels (supported16)
  std::vector<torch::Tensor> weights;
  std::vector<c10::optional<torch::Tensor>> scales, zeros;  // per part (integer layouts), else none
  std::vector<int64_t> groups;                              // per part: group size, 0 for none
  c10::optional<torch::Tensor> perm;
  c10::optional<torch::Tensor> bias;
  bool bias_in_linear = false;
  int64_t K = 0;

  // levels as linear_q8 takes them; 16 (q16) falls back to 2 (q8x2) for a type without 16-bit
  // kernels, as kernels/quant.py levels_for does
  torch::Tensor part(const torch::Tensor& x, size_t i, int64_t levels) const {
    if (qtypes[i] == kDense) return dense_linear(x, weights[i], c10::nullopt);
    if (levels == 16 && !has16[i]) levels = 2;
    return linear_q8(x, weights[i], qtypes[i], K, scales[i], zeros[i], groups[i], c10::nullopt, levels);
  }

  torch::Tensor operator()(const torch::Tensor& x_in, int64_t levels) const {
    if (bias_in_linear) return dense_linear(x_in, weights[0], bias);
    const torch::Tensor x = perm ? x_in.index_select(1, *perm) : x_in;
    torch::Tensor y;
    if (weights.size() == 1) {
      y = part(x, 0, levels);
    } else {
      std::vector<torch::Tensor> ys;
      for (size_t i = 0; i < weights.size(); ++i) ys.push_back(part(x, i, levels));
      y = at::cat(ys, -1);
    }
    if (bias) y.add_(*bias);
    return y;
  }
};

struct Layer {
  torch::Tensor in_norm, post_attn_norm;
  c10::optional<torch::Tensor> pre_ff_norm, post_ff_norm, q_norm, k_norm;  // gemma3
  Linear qkv, o, gate_up, down;
  torch::Tensor cos, sin;  // RoPE tables [P, D / 2]
  int64_t hq = 0, hk = 0, d = 0, window = -1, act = 0;
  double eps = 1e-6, scale = 1.0, softcap = 0.0;
};

c10::optional<torch::Tensor> opt_tensor(const py::dict& s, const char* key) {
  if (!s.contains(key) || s[key].is_none()) return c10::nullopt;
  return s[key].cast<torch::Tensor>();
}

// `key` of a linear's spec: a list of n tensors or Nones (absent: n Nones)
std::vector<c10::optional<torch::Tensor>> opt_tensor_list(const py::dict& l, const char* key, size_t n,
                                                          const char* linear) {
  std::vector<c10::optional<torch::Tensor>> out(n);
  if (!l.contains(key) || l[key].is_none()) return out;
  const py::list items = l[key].cast<py::list>();
  TORCH_CHECK(items.size() == n, "decode step: '", linear, "' needs one entry of '", key, "' per weight part");
  for (size_t i = 0; i < n; ++i)
    if (!items[i].is_none()) out[i] = items[i].cast<torch::Tensor>();
  return out;
}

Linear to_linear(const py::dict& s, const char* key) {
  TORCH_CHECK(s.contains(key), "decode step: layer spec has no '", key, "'");
  const py::dict l = s[key].cast<py::dict>();
  Linear out;
  out.qtypes = l["qtypes"].cast<std::vector<int64_t>>();
  out.weights = l["weights"].cast<std::vector<torch::Tensor>>();
  out.K = l["in_features"].cast<int64_t>();
  out.bias = opt_tensor(l, "bias");
  out.bias_in_linear = l.contains("bias_in_linear") && l["bias_in_linear"].cast<bool>();
  TORCH_CHECK(!out.weights.empty() && out.weights.size() == out.qtypes.size(), "decode step: '", key,
              "' needs one qtype per weight part");
  TORCH_CHECK(!out.bias_in_linear || (out.weights.size() == 1 && out.qtypes[0] == kDense),
              "decode step: a bias inside the product needs one dense part");
  const size_t n = out.weights.size();
  out.scales = opt_tensor_list(l, "scales", n, key);
  out.zeros = opt_tensor_list(l, "zeros", n, key);
  out.groups = l.contains("groups") ? l["groups"].cast<std::vector<int64_t>>() : std::vector<int64_t>(n, 0);
  TORCH_CHECK(out.groups.size() == n, "decode step: '", key, "' needs one group size per weight part");
  out.perm = opt_tensor(l, "perm");
  TORCH_CHECK(!out.perm || !out.bias_in_linear, "decode step: a permuted input with the bias inside the product");
  for (size_t i = 0; i < out.weights.size(); ++i) {
    TORCH_CHECK(out.qtypes[i] == kDense || supported(out.qtypes[i]), "decode step: '", key, "' part ", i,
                " has type ", out.qtypes[i], " without kernels");
    out.has16.push_back(out.qtypes[i] != kDense && supported16(out.qtypes[i]));
  }
  return out;
}

torch::Tensor rows_contiguous(const torch::Tensor& x) {
  return x.stride(2) == 1 && x.stride(1) == x.size(2) ? x : x.contiguous();
}

class DecodeStep {
 public:
  // spec keys: in_norm, post_attn_norm, [pre_ff_norm, post_ff_norm, q_norm, k_norm], qkv, o,
  // gate_up, down (each {qtypes, weights, in_features, [scales, zeros, groups: per part],
  // [perm], [bias], [bias_in_linear]}), cos, sin,
  // num_heads, num_kv_heads, head_dim, window (-1: none), act (gated_act code), eps, scale,
  // softcap (0: none). All layers must be of one kind (with or without the gemma3 norms).
  void add_layer(const py::dict& s) {
    Layer L;
    L.in_norm = s["in_norm"].cast<torch::Tensor>();
    L.post_attn_norm = s["post_attn_norm"].cast<torch::Tensor>();
    L.pre_ff_norm = opt_tensor(s, "pre_ff_norm");
    L.post_ff_norm = opt_tensor(s, "post_ff_norm");
    L.q_norm = opt_tensor(s, "q_norm");
    L.k_norm = opt_tensor(s, "k_norm");
    TORCH_CHECK(L.pre_ff_norm.has_value() == L.post_ff_norm.has_value(), "decode step: pre/post FF norms go together");
    TORCH_CHECK(L.q_norm.has_value() == L.k_norm.has_value(), "decode step: q/k norms go together");
    TORCH_CHECK(layers_.empty() || layers_[0].pre_ff_norm.has_value() == L.pre_ff_norm.has_value(),
                "decode step: layers of two kinds");
    L.qkv = to_linear(s, "qkv");
    L.o = to_linear(s, "o");
    L.gate_up = to_linear(s, "gate_up");
    L.down = to_linear(s, "down");
    L.cos = s["cos"].cast<torch::Tensor>();
    L.sin = s["sin"].cast<torch::Tensor>();
    L.hq = s["num_heads"].cast<int64_t>();
    L.hk = s["num_kv_heads"].cast<int64_t>();
    L.d = s["head_dim"].cast<int64_t>();
    L.window = s["window"].cast<int64_t>();
    L.act = s["act"].cast<int64_t>();
    L.eps = s["eps"].cast<double>();
    L.scale = s["scale"].cast<double>();
    L.softcap = s["softcap"].cast<double>();
    layers_.push_back(std::move(L));
  }

  // Each layer's K and V storage and its KV-cache group (which block table and slot mapping of a
  // step it reads).
  void set_kv_caches(std::vector<torch::Tensor> k, std::vector<torch::Tensor> v, std::vector<int64_t> groups) {
    TORCH_CHECK(k.size() == layers_.size() && v.size() == layers_.size() && groups.size() == layers_.size(),
                "decode step: one K cache, one V cache and one group per layer");
    k_ = std::move(k);
    v_ = std::move(v);
    groups_ = std::move(groups);
  }

  // A quantized K/V format (kv_quant.h): per layer {kq, vq, k_scale, v_scale, k_ring, v_ring}; each step
  // then brings `recent`: per group its sequences' ring slots, first new positions, quantized bounds
  // before and after the step, and each row's read bound (kv_quant.py's RecentMeta).
  void set_quant_kv(std::vector<std::vector<torch::Tensor>> kv, int64_t ring_blocks, int64_t bits) {
    TORCH_CHECK(kv.size() == layers_.size(), "decode step: one quantized K/V storage per layer");
    qkv_ = std::move(kv);
    ring_blocks_ = ring_blocks;
    bits_ = bits;
  }

  // Per KV-cache group, the window its KV policy sets (-1: each layer's own) and its attention sinks
  // (0: none; StreamingLLM): a sink layer scores the sinks with its queries rotated to
  // min(p, sinks + window - 1), as attention/backend.py's sinks do.
  // An attention-score eviction policy's step (attention/key_mass.py): per sequence the first row whose
  // attention counts, and the [B, width] mass per table entry each layer adds to; None: no scores.
  void set_key_mass(c10::optional<torch::Tensor> first_rows, c10::optional<torch::Tensor> out) {
    TORCH_CHECK(first_rows.has_value() == out.has_value(), "decode step: key mass needs both first rows and out");
    TORCH_CHECK(!out || qkv_.empty(), "decode step: key mass over quantized K/V is not built");
    mass_first_ = first_rows;
    mass_out_ = out;
  }

  void set_group_attention(std::vector<int64_t> windows, std::vector<int64_t> sinks) {
    TORCH_CHECK(windows.size() == sinks.size(), "decode step: one window and one sink count per group");
    for (size_t g = 0; g < sinks.size(); ++g)
      TORCH_CHECK(sinks[g] == 0 || windows[g] > 0, "decode step: group ", g, " has sinks but no window");
    group_window_ = std::move(windows);
    group_sinks_ = std::move(sinks);
  }

  // Hooks, called with (layer index, tensor) and allowed to change the tensor in place: after each
  // attention output projection and each MLP down projection, before any norm (where a tensor-
  // parallel all-reduce goes). None: no call. The module path calls the same hooks at the same points.
  void set_hooks(py::object attn_out, py::object mlp_out) {
    attn_out_ = std::move(attn_out);
    mlp_out_ = std::move(mlp_out);
  }

  // Layers [start, end) of a step. x [T, hidden]: layer start's input (the embedded new tokens
  // when start is 0); residual: the residual stream coming in (None before layer 0; a pipeline stage
  // holding layers from some later one has it at its layer 0). block_tables
  // and slot_mappings: one per KV-cache group. query_start_loc [B + 1]: sequence b's new tokens are
  // rows [qsl[b], qsl[b + 1]) (attended one decode per token when no sequence brings more than
  // kSmallQueryMax, else by the tiled kernel, paged_attention); None: one new token per sequence.
  // Returns (block output, residual stream) after layer end - 1, as the module path leaves them for
  // the next layer or the final norm.
  std::vector<torch::Tensor> forward(torch::Tensor x, c10::optional<torch::Tensor> residual_in, torch::Tensor positions,
                                     std::vector<torch::Tensor> block_tables, torch::Tensor seq_lens,
                                     std::vector<torch::Tensor> slot_mappings, c10::optional<torch::Tensor> query_start_loc,
                                     int64_t levels, int64_t start, int64_t end, std::vector<torch::Tensor> recent) {
    TORCH_CHECK(!layers_.empty() && k_.size() == layers_.size(), "decode step: no layers or no KV caches");
    TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat32, "decode step: x must be float32 [B, hidden]");
    TORCH_CHECK(0 <= start && start < end && end <= (int64_t)layers_.size(), "decode step: bad layer range");
    TORCH_CHECK(residual_in.has_value() || start == 0, "decode step: layers after the first need the residual stream");
    for (int64_t g : groups_)
      TORCH_CHECK(g >= 0 && g < (int64_t)block_tables.size() && g < (int64_t)slot_mappings.size(),
                  "decode step: a layer's KV group has no block table or slot mapping");
    const int64_t B = x.size(0);
    // small-query steps (every sequence brings at most kSmallQueryMax tokens) attend with the decode
    // kernel, one decode per new token, as the module path does (attention/backend.py)
    bool tiled = false;
    if (query_start_loc) {
      const auto qsl = query_start_loc->to(torch::kInt64).contiguous();
      const int64_t* qs = qsl.data_ptr<int64_t>();
      for (int64_t s = 0; s + 1 < qsl.numel(); ++s) tiled = tiled || qs[s + 1] - qs[s] > kSmallQueryMax;
    }
    torch::Tensor residual = residual_in ? *residual_in : torch::Tensor();
    const bool quant = !qkv_.empty();
    torch::Tensor qsl_all;  // the write of a quantized format needs every sequence's rows
    if (quant) {
      TORCH_CHECK(recent.size() == 5 * block_tables.size(), "decode step: quantized K/V needs its recent data per group");
      qsl_all = query_start_loc ? *query_start_loc : torch::arange(B + 1, torch::kInt64);
    }
    torch::Tensor mass_qsl;  // an eviction policy's scores: every sequence's rows, once per step
    if (mass_out_) mass_qsl = query_start_loc ? *query_start_loc : torch::arange(B + 1, torch::kInt64);
    std::vector<torch::Tensor> sink_pos(group_sinks_.size());  // per sink group: min(p, sinks + window - 1)
    for (size_t g = 0; g < group_sinks_.size(); ++g)
      if (group_sinks_[g] > 0) sink_pos[g] = positions.clamp_max(group_sinks_[g] + group_window_[g] - 1);
    for (int64_t i = start; i < end; ++i) {
      const Layer& L = layers_[i];
      torch::Tensor h;
      if (!residual.defined()) {  // the model's first layer
        residual = x;
        h = rms_norm(x, L.in_norm, L.eps, c10::nullopt);
      } else {
        h = rms_norm(x, L.in_norm, L.eps, residual);
      }
      const torch::Tensor qkv = L.qkv(h, levels);
      const int64_t qs = L.hq * L.d, ks = L.hk * L.d;
      auto parts = qkv.split_with_sizes({qs, ks, ks}, -1);
      torch::Tensor q = parts[0].reshape({-1, L.hq, L.d});
      torch::Tensor k = parts[1].reshape({-1, L.hk, L.d});
      torch::Tensor v = parts[2].reshape({-1, L.hk, L.d});
      if (L.q_norm) {
        q = rms_norm(q, *L.q_norm, L.eps, c10::nullopt);
        k = rms_norm(k, *L.k_norm, L.eps, c10::nullopt);
      }
      const int64_t g = groups_[i];
      const bool policy = g < (int64_t)group_window_.size();
      const int64_t window = policy && group_window_[g] > 0 ? group_window_[g] : L.window;
      const int64_t sinks = policy ? group_sinks_[g] : 0;
      c10::optional<torch::Tensor> q_sink;
      if (sinks > 0) q_sink = q.clone(at::MemoryFormat::Contiguous);  // before its rotation
      rope_(q, k, positions, L.cos, L.sin);
      if (q_sink) rope_(*q_sink, q_sink->narrow(1, 0, 0), sink_pos[g], L.cos, L.sin);
      torch::Tensor a;
      if (quant) {
        const auto& kv = qkv_[i];
        const torch::Tensor &slots = recent[5 * g], &first = recent[5 * g + 1], &old = recent[5 * g + 2],
                            &fresh = recent[5 * g + 3], &read = recent[5 * g + 4];
        paged_write_kv_quant(rows_contiguous(k), rows_contiguous(v), kv[0], kv[1], kv[2], kv[3], kv[4], kv[5],
                             block_tables[g], qsl_all, slots, first, old, fresh, ring_blocks_, bits_);
        a = (tiled ? paged_attention_quant(rows_contiguous(q), kv, block_tables[g], *query_start_loc, seq_lens, slots,
                                           fresh, ring_blocks_, bits_, L.scale, window, L.softcap)
                   : paged_decode_attention_quant(rows_contiguous(q), kv, block_tables[g], seq_lens, slots, read,
                                                  ring_blocks_, bits_, L.scale, window, L.softcap, query_start_loc))
                .reshape({B, -1});
      } else {
      paged_write_kv(rows_contiguous(k), rows_contiguous(v), k_[i], v_[i], slot_mappings[g]);
      a = (tiled ? paged_attention(rows_contiguous(q), k_[i], v_[i], block_tables[g], *query_start_loc,
                                                 seq_lens, L.scale, window, L.softcap, sinks, q_sink)
                               : paged_decode_attention(rows_contiguous(q), k_[i], v_[i], block_tables[g], seq_lens,
                                                        L.scale, window, L.softcap, query_start_loc, sinks, q_sink))
                            .reshape({B, -1});
      if (mass_out_)  // an eviction policy's scores: this layer's attention mass per table entry
        paged_key_mass(rows_contiguous(q), k_[i], block_tables[g], mass_qsl, seq_lens, *mass_first_, L.scale,
                       L.softcap, *mass_out_);
      }
      torch::Tensor o = L.o(a, levels);
      call_hook(attn_out_, i, o);
      if (L.pre_ff_norm) {
        h = rms_norm(rms_norm(o, L.post_attn_norm, L.eps, c10::nullopt), *L.pre_ff_norm, L.eps, residual);
      } else {
        h = rms_norm(o, L.post_attn_norm, L.eps, residual);
      }
      torch::Tensor m = L.down(gated_act(L.gate_up(h, levels), L.act), levels);
      call_hook(mlp_out_, i, m);
      x = L.post_ff_norm ? rms_norm(m, *L.post_ff_norm, L.eps, c10::nullopt) : m;
    }
    return {x, residual};
  }

 private:
  static void call_hook(const py::object& hook, int64_t layer, const torch::Tensor& t) {
    if (!hook || hook.is_none()) return;
    py::gil_scoped_acquire gil;
    hook(layer, t);
  }

  std::vector<Layer> layers_;
  py::object attn_out_, mlp_out_;
  std::vector<torch::Tensor> k_, v_;
  std::vector<int64_t> groups_;
  std::vector<int64_t> group_window_, group_sinks_;  // per KV-cache group (empty: the layers' own, no sinks)
  std::vector<std::vector<torch::Tensor>> qkv_;  // a quantized format's storage per layer (empty: float K/V)
  int64_t ring_blocks_ = 0, bits_ = 0;
  c10::optional<torch::Tensor> mass_first_, mass_out_;  // an eviction policy's step: key mass (set_key_mass)
};

}  // namespace

void bind_decode_step(py::module_& m) {
  py::class_<DecodeStep>(m, "DecodeStep", "every decoder layer of a decode step in one call (decode_step.cpp)")
      .def(py::init<>())
      .def("add_layer", &DecodeStep::add_layer, "append a layer described by a dict of tensors and constants")
      .def("set_kv_caches", &DecodeStep::set_kv_caches, "the paged K and V storage and the KV group of every layer")
      .def("set_quant_kv", &DecodeStep::set_quant_kv,
           "a quantized K/V format: per layer its integers, scales and rings; ring blocks per slot; bits")
      .def("set_key_mass", &DecodeStep::set_key_mass, "per sequence the first counted row and the [B, width] "
           "attention mass per table entry each layer adds to (None, None: no scores)")
      .def("set_group_attention", &DecodeStep::set_group_attention,
           "per KV-cache group, its policy's window (-1: the layers' own) and attention sinks")
      .def("set_hooks", &DecodeStep::set_hooks, "callables (layer, tensor) after attention and MLP outputs, or None")
      .def("forward", &DecodeStep::forward, "run layers [start, end); returns (block output, residual stream)",
           py::call_guard<py::gil_scoped_release>());
}
