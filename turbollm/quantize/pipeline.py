"""Layer-by-layer offline quantization: the driver shared by GPTQ and AWQ.

For each decoder layer, for each residual branch (attention, then MLP; see `models/branches.py`):

1. every calibration batch: ``h = norm(x)`` → the algorithm observes `first`'s input;
   `first_ready` (GPTQ quantizes `first` here);
2. the batches the algorithm asks for: run the branch up to `second`'s input ``z`` (with
   `first` as it now is) → the algorithm observes it; `second_ready` (GPTQ quantizes `second`;
   AWQ searches and folds its scales, clips, and quantizes both linears);
3. every batch: ``x ← x + post(y)`` with the quantized branch, for what comes next. When
   `first` was final before step 2 and the ``z`` of every batch fit in `STORE_BUDGET`, ``y``
   is `second(z)` (no recomputation), otherwise the branch is run again.

So each linear is quantized from inputs that went through every linear quantized before it
(GPTQ's "true sequential" order), and the next layer sees the quantized layer's output.
Quantized linears keep working in float32 with their dequantized weights ("fake quant"); the
codes, scales and zeros go to `results` under the layer's module name, for export.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch
from torch import nn

from turbollm.layers.linear import LinearBase
from turbollm.models.branches import Branch, get_adapter
from turbollm.quantization.group_quant import QuantizedWeight
from turbollm.quantize.calibration_runner import CalibrationRunner, capture_input, run_until_captured

STORE_BUDGET = 1536 << 20  # bytes of `second`'s inputs kept to skip recomputing a branch


class BranchAlgorithm:
    """What an offline quantizer does at each step of `run_branch`."""

    #: True when `first` no longer changes after `first_ready` (step 3 may reuse stored inputs).
    first_final_early = False

    def __init__(self) -> None:
        self.results: dict[str, QuantizedWeight] = {}
        self.names: dict[int, str] = {}

    def name(self, linear: nn.Module) -> str:
        return self.names[id(linear)]

    def prepare(self, runner: CalibrationRunner) -> None:
        """Called once, before the first layer."""

    def stage2_batches(self, runner: CalibrationRunner) -> list[int]:
        return list(range(len(runner.batches)))

    def observe_first(self, br: Branch, h: torch.Tensor, index: int) -> None:
        raise NotImplementedError

    def first_ready(self, br: Branch) -> None:
        pass

    def observe_second(self, br: Branch, z: torch.Tensor, index: int) -> None:
        raise NotImplementedError

    def second_ready(self, br: Branch) -> None:
        raise NotImplementedError

    def store(self, linear: LinearBase, qw: QuantizedWeight) -> None:
        """Record `qw` for `linear` and make the layer compute with its dequantized weight."""
        self.results[self.name(linear)] = qw
        linear.weight.data.copy_(qw.dequantize())


@dataclass
class PipelineReport:
    layers: int = 0
    seconds: float = 0.0
    layer_seconds: list[float] = field(default_factory=list)


@torch.no_grad()
def run_branch(runner: CalibrationRunner, br: Branch, x: torch.Tensor, alg: BranchAlgorithm) -> None:
    """Steps 1-3 of the module docstring for one branch; updates `x` in place."""
    for i, (rows, _) in enumerate(runner.batches):
        alg.observe_first(br, br.norm(x[rows]), i)
    alg.first_ready(br)
    wanted = alg.stage2_batches(runner)
    second_in = br.second.in_features
    keep = alg.first_final_early and len(wanted) == len(runner.batches) \
        and runner.num_tokens * second_in * 4 <= STORE_BUDGET
    stored: dict[int, torch.Tensor] = {}
    with capture_input(br.second) as box:
        for i in wanted:
            rows, batch = runner.batches[i]
            z = run_until_captured(lambda: br.inner(br.norm(x[rows]), batch), box)
            alg.observe_second(br, z, i)
            if keep:
                stored[i] = z
    alg.second_ready(br)
    for i, (rows, batch) in enumerate(runner.batches):
        z = stored.pop(i, None)
        y = br.second(z) if z is not None else br.inner(br.norm(x[rows]), batch)
        x[rows] = br.residual(x[rows], y)


def quantize_decoder(model: nn.Module, windows: torch.Tensor, alg: BranchAlgorithm, *, progress: bool = True,
                     desc: str = "quantize") -> PipelineReport:
    """Run `alg` over every decoder layer of `model` (float32, method "none") on `windows`."""
    from tqdm import tqdm

    adapter = get_adapter(model.config.arch)
    alg.names = {id(m): n for n, m in model.named_modules() if isinstance(m, LinearBase)}
    runner = CalibrationRunner(model, windows)
    alg.prepare(runner)
    report = PipelineReport()
    t0 = time.perf_counter()
    x = runner.embed(adapter)
    layers = model.model.layers
    with tqdm(total=len(layers), desc=desc, unit="layer", disable=not progress) as bar:
        for layer in layers:
            t = time.perf_counter()
            for br in adapter.branches(layer):
                bar.set_postfix_str(br.name)
                run_branch(runner, br, x, alg)
            report.layer_seconds.append(time.perf_counter() - t)
            bar.update(1)
    report.layers = len(layers)
    report.seconds = time.perf_counter() - t0
    return report
