"""The offline API, named as vLLM names it: `LLM(model).generate(prompts, SamplingParams(...))`."""

from __future__ import annotations

from typing import Any, Sequence

from turbollm.engine.llm_engine import LLMEngine
from turbollm.engine_args import EngineArgs
from turbollm.outputs import RequestOutput
from turbollm.sampling_params import SamplingParams

PromptType = str | dict[str, Any] | list[int]


class LLM:
    """Load a model once; generate for batches of prompts.

    `model` is a catalog name (pulled on first use), a GGUF file, a Hugging Face folder or a
    hub id. Keyword arguments are engine arguments (`max_num_seqs`, `block_size`,
    `kv_cache_memory`, `seed`, ...; see `EngineArgs`).
    """

    def __init__(self, model: str = "smollm2-135m", **engine_args: Any):
        self.engine = LLMEngine.from_engine_args(EngineArgs.from_kwargs(model, **engine_args))

    def get_tokenizer(self):
        return self.engine.tokenizer

    def generate(self, prompts: PromptType | Sequence[PromptType],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = True) -> list[RequestOutput]:
        """Run every prompt to completion; outputs come back in the order of the prompts.

        A request the engine had to fail alone comes back finished with `finish_reason="error"` and
        `RequestOutput.error` saying why; an exception from the engine (or Ctrl-C) aborts every
        request of this call before it propagates."""
        if isinstance(prompts, (str, dict)) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        prompts = list(prompts)
        if sampling_params is None:
            sampling_params = SamplingParams()
        params = list(sampling_params) if isinstance(sampling_params, (list, tuple)) else [sampling_params] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"got {len(prompts)} prompts but {len(params)} SamplingParams")
        engine = self.engine
        ids = []
        try:
            for prompt, p in zip(prompts, params):
                ids.append(engine.add_request(prompt, p))
        except Exception:
            for rid in ids:
                engine.abort(rid)
            raise
        return self._run(ids, use_tqdm)

    def _run(self, ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        from tqdm import tqdm

        results: dict[str, RequestOutput] = {}
        engine = self.engine
        try:
            with tqdm(total=len(ids), desc="generating", unit="req", disable=not use_tqdm or len(ids) < 2) as bar:
                while engine.has_unfinished_requests():
                    for out in engine.step():
                        if out.finished:
                            results[out.request_id] = out
                            bar.update(1)
        except BaseException:  # an error or Ctrl-C: nothing of this call stays in the engine for the next
            for rid in ids:
                engine.abort(rid)
            raise
        return [results[i] for i in ids]

    def chat(self, messages: list[dict[str, Any]] | list[list[dict[str, Any]]],
             sampling_params: SamplingParams | None = None, use_tqdm: bool = True,
             add_generation_prompt: bool = True) -> list[RequestOutput]:
        """Render each conversation with the model's chat template and generate the reply."""
        convs = [messages] if messages and isinstance(messages[0], dict) else messages
        tok = self.engine.tokenizer
        prompts = [{"prompt_token_ids": tok.encode(tok.apply_chat_template(c, add_generation_prompt=add_generation_prompt),
                                                   add_special_tokens=False)} for c in convs]
        return self.generate(prompts, sampling_params, use_tqdm)
