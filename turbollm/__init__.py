"""turbollm: an LLM inference engine."""
