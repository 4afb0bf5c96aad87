"""Typed exceptions raised at turbollm's boundaries.

Every error a user can cause (an unknown model name, a corrupt file, a prompt that is too
long) is one of these, with a message that names the file, tensor or limit involved. Asserts
are kept for internal invariants only.
"""

import json
from typing import Any


class TurboLLMError(Exception):
    """Base class of every error turbollm raises on purpose."""


class UnknownModelError(TurboLLMError, KeyError):
    """A model name that is neither in the catalog nor a local path."""

    def __str__(self) -> str:  # KeyError would quote the message
        return str(self.args[0]) if self.args else ""


class ModelDownloadError(TurboLLMError):
    """A catalog model could not be fetched (network, package index, missing member)."""


class ChecksumMismatchError(TurboLLMError):
    """An assembled model file does not have the sha256 the catalog records."""


class ModelFormatError(TurboLLMError):
    """A checkpoint file is truncated, corrupt or not in the expected layout."""


class UnsupportedArchitectureError(TurboLLMError):
    """A checkpoint of an architecture turbollm has no implementation of."""


class UnsupportedTensorTypeError(TurboLLMError):
    """A GGUF tensor stored in a block type turbollm cannot decode."""


class WeightLoadError(TurboLLMError):
    """Missing, unexpected or mis-shaped tensors while loading weights."""


class InvalidRequestError(TurboLLMError, ValueError):
    """A request the engine cannot serve as given (empty prompt, over the context, bad params)."""


class BenchmarkError(TurboLLMError):
    """A benchmark that cannot run as asked (missing data file, impossible lengths, an option not built yet)."""


def json_object(value: Any, name: str) -> Any:
    """`value` as given, or parsed when it is JSON text; InvalidRequestError naming `name` unless it is then a JSON
    object (a dict) — the engine arguments that take a JSON object (speculative_config, kv_transfer_config)."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise InvalidRequestError(f"{name}: not valid JSON ({e.msg} at character {e.pos})") from None
    if not isinstance(value, dict):
        raise InvalidRequestError(f"{name} must be a JSON object, got {type(value).__name__}")
    return value
