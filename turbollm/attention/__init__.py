"""Attention over a paged KV cache: per-step metadata, and backends chosen by device."""

from turbollm.attention.metadata import AttentionMetadata
from turbollm.attention.backend import ATTENTION_BACKENDS, AttentionBackend, get_attention_backend

__all__ = ["AttentionMetadata", "ATTENTION_BACKENDS", "AttentionBackend", "get_attention_backend"]
