"""Shared test helpers: catalog models (pulled on first use) and the shared data folder."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

SHARED_DATA = Path(__file__).resolve().parents[2] / "shared" / "data"


def catalog_model_path(name: str, download: bool | None = None) -> Path:
    """The GGUF file of catalog model `name`, pulled if missing.

    Set TURBOLLM_TEST_OFFLINE=1 to skip model tests instead of downloading; pass
    download=False for optional models that are only checked when already cached.
    """
    from turbollm.errors import ModelDownloadError, UnknownModelError
    from turbollm.hub.resolve import resolve_model

    if download is None:
        download = os.environ.get("TURBOLLM_TEST_OFFLINE") != "1"
    try:
        return resolve_model(name, download=download).path
    except (UnknownModelError, ModelDownloadError) as e:
        pytest.skip(f"model {name} is not available: {e}")
