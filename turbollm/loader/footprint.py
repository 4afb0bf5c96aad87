"""A loaded model's footprint as plain data: what its weights hold and what a step multiplies.

Workers report it to the engine (an engine with a worker process has no model of its own), and
the benchmarks' physics read it: resident weight bytes (shared tensors once), the bytes of an
untied input-embedding table (a step reads only its tokens' rows), the decoder's linear
parameters by their logical shape (packed and quantized weights too), the LM head's, and how the
weights are stored.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ModelFootprint:
    weight_bytes: int
    untied_embedding_bytes: int
    linear_params: int
    lm_head_params: int
    weights_storage: str  # e.g. "gguf: Q4_1 66.4 MB, Q8_0 30.1 MB, float32 0.1 MB"
    file_tensor_bytes: int  # tensor bytes in the checkpoint file(s)

    @classmethod
    def of_stages(cls, stages: list["ModelFootprint"]) -> "ModelFootprint":
        """A pipeline's footprint: its stages' (one rank of each) together, since a step passes through them
        all (a tied table held by two stages counts twice: it is)."""
        return cls(sum(f.weight_bytes for f in stages), sum(f.untied_embedding_bytes for f in stages),
                   sum(f.linear_params for f in stages), sum(f.lm_head_params for f in stages),
                   " | ".join(f"stage {i}: {f.weights_storage}" for i, f in enumerate(stages)),
                   stages[0].file_tensor_bytes)


def unique_bytes(params) -> int:
    """Bytes of the tensors `params`, each storage counted once."""
    seen, total = set(), 0
    for p in params:
        if p.data_ptr() not in seen:
            seen.add(p.data_ptr())
            total += p.numel() * p.element_size()
    return total


def model_footprint(loaded) -> ModelFootprint:
    """Count a `LoadedModel` (a tensor-parallel rank's: its shard of every matrix and of the vocabulary)."""
    from turbollm.layers.embedding import LMHead, VocabEmbedding
    from turbollm.layers.linear import LinearBase

    linear = lm_head = 0
    head_ptrs, embed_tables = set(), []
    for m in loaded.model.modules():
        if isinstance(m, LinearBase):
            linear += m.in_features * m.out_features
        elif isinstance(m, LMHead):
            lm_head += m.local_vocab * m.dim  # this rank's rows; logical size: the table may be raw GGML blocks
            head_ptrs.add(m.weight.data_ptr())
        elif isinstance(m, VocabEmbedding):
            embed_tables.append(m.weight)
    untied = unique_bytes(w for w in embed_tables if w.data_ptr() not in head_ptrs)
    return ModelFootprint(loaded.weight_bytes, untied, linear, lm_head, loaded.weights_storage,
                          loaded.file_tensor_bytes)
