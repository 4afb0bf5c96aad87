"""Kernel forms (turbollm/kernels/forms.py): every form this CPU runs, against the references.

- The forms the module reports follow the CPU's flags (/proc/cpuinfo), and a form the CPU cannot run
  is refused by name, with the forms it can.
- Repacking (csrc/quant_repack.cpp) rearranges each type's bits within the same bytes: unpacking gives
  the GGML rows back bit for bit, on any CPU.
- avx2_tiles (every CPU) and avx512_vnni (where the CPU runs it): the tile kernels equal ``q8_linear_ref``
  (one or two int8 levels in blocks of 32) for every repacked type and row count, with every code at
  its extreme too (no int16 sum of the AVX2 form saturates); dequantizing and looking rows up from a
  repacked weight is bit-exact with the GGML decoders; a row's product is the same bits alone as among
  64 (row invariance at any batch size); where both run, the two forms give the same bits; the AVX-512
  object file defines nothing outside its own namespace, so no inline function compiled for AVX-512 can
  stand in for another's.
- `set_kernel_form` repacks a model's weights and restores them bit for bit.
The avx2 form's kernels are tested by tests/test_quant_kernels.py on every CPU.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest
import torch
from gguf import GGMLQuantizationType as T

from turbollm.errors import InvalidRequestError
from turbollm.formats.ggml_types import dequantize, dequantize_rows
from turbollm.kernels import cpu_flags, get_kernels
from turbollm.kernels import forms as F
from turbollm.kernels import quant as Q
from turbollm.kernels.quant_activations import q8_linear_ref
from turbollm.kernels.random_weights import random_weight

needs_kernels = pytest.mark.usefixtures("needs_kernels")
REPACKED = [T[name] for name in F.REPACKED_TYPES]
#: the forms whose tile kernels take any number of rows (amx: tested against avx512_vnni below)
TILE_FORMS = ["avx2_tiles", "avx512_vnni"]
VNNI512_FLAGS = {"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_vnni"}


def cpu_runs_vnni512() -> bool:
    return VNNI512_FLAGS <= set(cpu_flags().split())


vnni512 = pytest.mark.skipif(not cpu_runs_vnni512(), reason="this CPU has no AVX-512 VNNI: the form cannot run here")


def rel_err(y: torch.Tensor, ref: torch.Tensor) -> float:
    return float((y - ref).abs().max() / ref.abs().max().clamp_min(1e-30))


@needs_kernels
def test_forms_follow_the_cpu():
    forms = F.runnable_forms()
    assert forms[:2] == ("avx2", "avx2_tiles")
    assert ("avx512_vnni" in forms) == cpu_runs_vnni512()
    assert ("amx" not in forms) or "avx512_vnni" in forms
    assert F.resolve_form(None) == ("avx512_vnni" if cpu_runs_vnni512() else "avx2")
    with pytest.raises(InvalidRequestError, match="choose one of"):
        F.resolve_form("avx9000")


@needs_kernels
def test_a_form_the_cpu_cannot_run_is_refused(monkeypatch):
    monkeypatch.setattr(F, "runnable_forms", lambda: ("avx2",))
    with pytest.raises(InvalidRequestError, match="cannot run here: this CPU and build run avx2"):
        F.resolve_form("avx512_vnni")
    monkeypatch.setenv(F.FORM_ENV, "avx512_vnni")
    with pytest.raises(InvalidRequestError, match="cannot run here"):
        F.resolve_form(None)


@needs_kernels
@pytest.mark.parametrize("qtype", REPACKED, ids=lambda t: t.name)
def test_repacking_is_a_permutation(qtype):
    mod = get_kernels()
    g = torch.Generator().manual_seed(int(qtype))
    k = 512
    w = random_weight(qtype, 48, k, g)
    r = mod.repack(w, int(qtype), k)
    assert r.shape == w.shape and not torch.equal(r, w)
    assert torch.equal(mod.unrepack(r, int(qtype), k), w)
    with pytest.raises(RuntimeError, match="multiple of 16 rows"):
        mod.repack(w[:40], int(qtype), k)


def tile_form(form: str) -> int:
    """The repacked base of `form`, skipping the test where this CPU (or, for amx, its kernel) cannot run the
    form (compiling it is not testing it)."""
    if form not in F.runnable_forms():
        pytest.skip(f"this CPU does not run the {form} form")
    return F.REPACKING_FORMS[form]


@needs_kernels
@pytest.mark.parametrize("form", TILE_FORMS)
@pytest.mark.parametrize("qtype", REPACKED, ids=lambda t: t.name)
def test_tiles_against_the_reference(form, qtype):
    base = tile_form(form)
    g = torch.Generator().manual_seed(100 + int(qtype))
    n, k = 64, 512
    w = random_weight(qtype, n, k, g)
    r, rt = Q.repack(w, int(qtype), k, base)
    assert rt == base + int(qtype)
    wd = dequantize(w, qtype, (n, k))
    assert torch.equal(Q.ggml_dequantize(r, rt, k), wd)
    ids = torch.tensor([[0, 17, 63], [5, 5, 40]])
    assert torch.equal(Q.ggml_embedding(r, rt, k, ids), dequantize_rows(w, qtype, (n, k), ids.reshape(-1)).view(2, 3, k))
    for m in (1, 5, 8, 9, 70):
        x = torch.randn(m, k, generator=g)
        for path, levels in (("fast", 1), ("auto", 2), ("q8", 1), ("q8x2", 2), ("q16", 2)):
            y = Q.ggml_linear(x, r, rt, k, path=path)
            assert rel_err(y, q8_linear_ref(x, wd, 32, levels)) < 1e-5, (m, path)
        assert rel_err(Q.ggml_linear(x, r, rt, k, path="dequant"), x @ wd.T) < 1e-5


@needs_kernels
@pytest.mark.parametrize("form", TILE_FORMS)
@pytest.mark.parametrize("qtype", REPACKED, ids=lambda t: t.name)
@pytest.mark.parametrize("path", ["fast", "auto"])
def test_rows_alone_equal_rows_among_64(form, qtype, path):
    base = tile_form(form)
    g = torch.Generator().manual_seed(7)
    k = 512 if qtype >= T.Q2_K else 96
    r, rt = Q.repack(random_weight(qtype, 48, k, g), int(qtype), k, base)
    x = torch.randn(64, k, generator=g) * torch.rand(64, 1, generator=g) * 4
    together = Q.ggml_linear(x, r, rt, k, path=path)
    for i in range(64):
        assert torch.equal(Q.ggml_linear(x[i:i + 1], r, rt, k, path=path)[0], together[i]), i


#: per type: bytes per block, the byte offsets of its fp16 fields (scale, min), set to 1.0, and the byte its
#: codes (and scale bytes) are filled with: every code at its largest, Q8_0's int8 codes at +127 and -128
EXTREMES = {"Q4_0": (18, [0], 0xFF), "Q4_1": (20, [0, 2], 0xFF), "Q5_0": (22, [0], 0xFF), "Q5_1": (24, [0, 2], 0xFF),
            "Q8_0+": (34, [0], 0x7F), "Q8_0-": (34, [0], 0x80), "Q4_K": (144, [0, 2], 0xFF),
            "Q5_K": (176, [0, 2], 0xFF), "Q6_K": (210, [208], 0xFF)}


@needs_kernels
@pytest.mark.parametrize("form", TILE_FORMS)
@pytest.mark.parametrize("case", list(EXTREMES))
def test_integer_sums_at_the_extremes(form, case):
    """Every code, scale and min byte at its largest (Q8_0's int8 codes at +127 and at -128) against
    activations at +/-127: the int32 sums and the offsets stay exact (avx2_tiles: no int16 sum saturates)."""
    base = tile_form(form)
    qtype = T[case.rstrip("+-")]
    nbytes, fields, fill = EXTREMES[case]
    n, k = 16, 1024
    w = torch.full((n, k // (256 if qtype >= T.Q2_K else 32) * nbytes), fill, dtype=torch.uint8)
    blocks = w.view(n, -1, nbytes)
    for off in fields:
        blocks[:, :, off], blocks[:, :, off + 1] = 0x00, 0x3C  # fp16 1.0
    if qtype == T.Q6_K:
        blocks[:, :, 192:208] = 0x7F  # int8 scales at +127
    wd = dequantize(w, qtype, (n, k))
    r, rt = Q.repack(w, int(qtype), k, base)
    x = torch.full((4, k), 10.0)
    x[1], x[2, ::2] = -10.0, -10.0
    for path, levels in (("fast", 1), ("auto", 2)):
        assert rel_err(Q.ggml_linear(x, r, rt, k, path=path), q8_linear_ref(x, wd, 32, levels)) < 1e-5


#: forms that give the avx512_vnni form's bits, and the row counts each is held to it at
SAME_BITS = {"avx2_tiles": (1, 8, 37), "amx": (16, 37, 64)}


@needs_kernels
@vnni512
@pytest.mark.parametrize("form", list(SAME_BITS))
@pytest.mark.parametrize("qtype", REPACKED, ids=lambda t: t.name)
def test_form_gives_the_bits_of_the_vnni512_form(form, qtype):
    """Exact integer sums and the same float steps lane for lane: every row of the avx2_tiles form, and of the
    amx form's tile multiplies (whole tiles of 16 rows, VNNI tiles for the rest), is the avx512_vnni form's
    bits, both paths."""
    base = tile_form(form)
    g = torch.Generator().manual_seed(13)
    k = 512
    w = random_weight(qtype, 32, k, g)
    rv, tv = Q.repack(w, int(qtype), k, Q.REPACKED_BASE)
    rf, tf = Q.repack(w, int(qtype), k, base)
    assert torch.equal(rf, rv) and tf == base + int(qtype)
    for m in SAME_BITS[form]:
        x = torch.randn(m, k, generator=g)
        for path in ("fast", "auto"):
            assert torch.equal(Q.ggml_linear(x, rf, tf, k, path=path), Q.ggml_linear(x, rv, tv, k, path=path)), (m, path)


@needs_kernels
@vnni512
def test_wide_target_objects_define_nothing_outside_their_namespaces():
    """Symbols of the translation units compiled for wider targets than the module's (qmm_vnni512.o,
    qmm_amx.o, peak_loops.o): their own namespaces only (and the plain functions the rest calls), no weak
    (COMDAT) definitions, which the linker could pick over another translation unit's copy of the same
    inline function and run on a CPU without those instructions."""
    nm = shutil.which("nm")
    assert nm, "binutils' nm is needed (it comes with gcc)"
    allowed = {"qmm_vnni512.o": ("tq::v512::",), "qmm_amx.o": ("tq::amx::", "tq::amx_ready()"),
               "peak_loops.o": ("tq::peak::",)}
    for name, prefixes in allowed.items():
        obj = Path(get_kernels().__file__).parent / name
        assert obj.exists(), f"no {obj}: the build folder layout changed"
        lines = subprocess.run([nm, "-C", "--defined-only", str(obj)], capture_output=True, text=True,
                               check=True).stdout.splitlines()
        # (DW.ref.__gxx_personality_v0: the exception tables' pointer to the C++ runtime, no code)
        defined = [ln for ln in lines if re.match(r"^[0-9a-f]+ [TtWwVvDdBbRr] ", ln) and " DW.ref." not in ln]
        assert defined, f"nm listed nothing in {name}"
        weak = [ln for ln in defined if ln.split()[1] in "WwVv"]
        assert not weak, (name, weak)
        outside = [ln for ln in defined if ln.split()[1] in "TDBR" and not any(p in ln for p in prefixes)]
        assert not outside, (name, outside)


@needs_kernels
@pytest.mark.parametrize("form", TILE_FORMS)
def test_set_kernel_form_repacks_and_restores(tmp_path, form):
    from test_gguf_native import write_tiny_gguf
    from turbollm.loader import load_model
    from turbollm.quantization.base import set_kernel_form

    base = tile_form(form)
    loaded = load_model(str(write_tiny_gguf(tmp_path / "tiny.gguf")))
    model = loaded.model
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    version = model.weights_version
    assert set_kernel_form(model, form)
    assert model.weights_version == version + 1
    types = {int(getattr(p, "ggml_qtype", -1)) for p in model.parameters()}
    assert {base + int(T.Q4_0), base + int(T.Q8_0)} <= types
    assert not set_kernel_form(model, form)  # already there
    assert set_kernel_form(model, "avx2")
    after = dict(model.named_parameters())
    assert all(torch.equal(before[n], after[n]) for n in before)
    assert not any(Q.is_repacked(getattr(p, "ggml_qtype", 0)) for p in model.parameters())


@needs_kernels
def test_bench_kernels_reports_every_runnable_form(tmp_path, capsys):
    """`turbollm bench kernels` prints the ceilings and one row per form this CPU runs (no timing is judged)."""
    import json

    from turbollm.cli.main import main

    out = tmp_path / "k.json"
    assert main(["bench", "kernels", "--types", "Q4_0", "--shapes", "576x1536", "--m", "1", "17", "--reps", "1",
                 "--cold-mb", "1", "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "== ceilings (same threads) ==" in printed and "== kernels ==" in printed
    rec = json.loads(out.read_text())
    assert rec["peaks_gops"]["int8_avx2"] > 0 and rec["library_gops"]["fp32_linear"] > 0
    forms = F.runnable_forms()
    assert {r["form"] for r in rec["rows"]} == set(forms)
    assert len(rec["rows"]) == 2 * len(forms)
    repacked = {r["path"] for r in rec["rows"] if r["form"] != "avx2"}
    assert repacked <= {"q8"}, repacked  # the repacked forms take one int8 level at every M under "fast"
