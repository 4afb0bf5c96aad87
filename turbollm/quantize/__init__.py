"""Offline quantization: tools that turn a model into a quantized checkpoint on disk.

Each tool is its own module, imported on demand (``turbollm quantize`` loads only the one a
method needs); for instance ``gguf_export.export_gguf`` writes llama.cpp-style GGUF files with
the block encoders of ``turbollm.formats.ggml_quantizers``.

Calibrated and round-to-nearest safetensors checkpoints (``--method gptq|awq|int4|int8``):
``runner`` (the command end to end) → ``methods`` (options and their checks) →
``calibration`` (ShareGPT token windows) → ``pipeline`` + ``quantize.calibration_runner`` (layer by layer,
branch by branch) with ``gptq`` / ``awq`` / ``rtn`` → ``export_safetensors`` + ``hf_folder``
(AutoGPTQ / AutoAWQ tensor layouts, config.json, tokenizer files, atomic folder writes).
"""
