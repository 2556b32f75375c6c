"""The A/B workloads: the benchmark models as parts, and the two sides (duplexpipe, torch pipelining)."""

from __future__ import annotations

import copy
import time
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, Callable

import torch
from torch import nn
from torch.distributed import pipelining as pp

from duplexpipe import Pipeline, PipelineConfig, PipelineRuntime, RuntimeConfig, Schedule, build_schedule


@dataclass(frozen=True)
class ModelSpec:
    """One benchmark workload: which model, how big, and the batch it trains on."""

    kind: str  # "mlp", "transformer" or "sleep"
    num_layers: int = 8  # blocks in the whole model; they are dealt evenly to the model parts
    width: int = 256  # hidden size (MLP width, transformer d_model, sleep model feature size)
    batch: int = 64  # samples per step (split into microbatches)
    seq: int = 32  # sequence length (transformer only)
    heads: int = 4  # attention heads (transformer only)
    sleep_ms: tuple[float, float, float] = (20.0, 20.0, 20.0)  # sleep model: ms per part in F, I and W
    seed: int = 0  # seed of the parameter init and of the data

    def describe(self) -> str:
        """A one-line human description."""
        if self.kind == "mlp":
            return f"{self.num_layers} x (Linear {self.width} + ReLU), batch {self.batch}"
        if self.kind == "transformer":
            return (f"{self.num_layers} transformer layers, d_model {self.width}, {self.heads} heads, "
                    f"seq {self.seq}, batch {self.batch}")
        f, i, w = self.sleep_ms
        return f"sleep model: F/I/W = {f:g}/{i:g}/{w:g} ms per part, {self.width} features, batch {self.batch}"


MLP = ModelSpec("mlp", num_layers=8, width=256, batch=64)  # the overhead-bound workload
TRANSFORMER = ModelSpec("transformer", num_layers=8, width=128, batch=32, seq=32)  # the compute-bound workload


SPIN_S = 3e-4
"""The sleep model's last stretch of each pause, spun rather than slept: a sleep overshoots by the OS's timer
slack and wake-up (0.1-0.3 ms here), which would put the model's costs above the simulator's."""


def hold(seconds: float) -> None:
    """Pause `seconds` as exactly as the clock allows: sleep all but the last SPIN_S, then spin to the deadline."""
    end = time.perf_counter() + seconds
    if seconds > SPIN_S:
        time.sleep(seconds - SPIN_S)
    while time.perf_counter() < end:
        pass


class _Sleep(torch.autograd.Function):
    """Identity that sleeps `fwd` seconds in forward (when nonzero) and `bwd` seconds in its backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, fwd: float, bwd: float) -> torch.Tensor:
        ctx.bwd = bwd
        if fwd:
            hold(fwd)
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        hold(ctx.bwd)
        return grad, None, None


class SleepPart(nn.Module):
    """y = x + bias with fixed sleeps: F in forward, I on the input path, W on the weight path (the bias is not on
    the input-gradient path: an input-only backward sleeps `i`, a weight-only one `w`, a full one both)."""

    def __init__(self, width: int, f_s: float, i_s: float, w_s: float) -> None:
        super().__init__()
        self.bias = nn.Parameter(torch.randn(width) * 0.01)
        self.f_s, self.i_s, self.w_s = f_s, i_s, w_s

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _Sleep.apply(x, self.f_s, self.i_s) + _Sleep.apply(self.bias, 0.0, self.w_s)


def build_parts(spec: ModelSpec, num_parts: int) -> list[nn.Module]:
    """The model as `num_parts` consecutive parts, identical on every process for one spec."""
    if spec.kind == "sleep":
        f, i, w = (ms / 1000.0 for ms in spec.sleep_ms)
        torch.manual_seed(spec.seed)
        return [SleepPart(spec.width, f, i, w) for _ in range(num_parts)]
    if spec.num_layers % num_parts:
        raise ValueError(f"{spec.num_layers} layers do not split evenly into {num_parts} parts")
    if spec.kind not in ("mlp", "transformer"):
        raise ValueError(f"unknown model kind {spec.kind!r}; expected mlp, transformer or sleep")
    torch.manual_seed(spec.seed)
    blocks = [nn.Sequential(nn.Linear(spec.width, spec.width), nn.ReLU()) if spec.kind == "mlp" else
              nn.TransformerEncoderLayer(spec.width, spec.heads, 4 * spec.width, dropout=0.0, batch_first=True)
              for _ in range(spec.num_layers)]
    per = spec.num_layers // num_parts
    return [nn.Sequential(*blocks[k * per:(k + 1) * per]) for k in range(num_parts)]


def make_batch(spec: ModelSpec) -> tuple[torch.Tensor, torch.Tensor]:
    """(inputs, targets) for one step, the same on every process."""
    gen = torch.Generator().manual_seed(spec.seed + 1)
    shape = (spec.batch, spec.seq, spec.width) if spec.kind == "transformer" else (spec.batch, spec.width)
    return torch.randn(shape, generator=gen), torch.randn(shape, generator=gen)


def loss_fn(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Per-microbatch loss: mean squared error."""
    return nn.functional.mse_loss(output, target)


def reference_grads(parts: list[nn.Module], inputs: torch.Tensor, targets: torch.Tensor, num_microbatches: int,
                    loss: Callable[..., torch.Tensor] = loss_fn) -> tuple[list[list[torch.Tensor]], float]:
    """Single-process gradients of the mean over microbatches of loss(mb); returns (grads per part, loss)."""
    model = nn.Sequential(*copy.deepcopy(parts))
    model.zero_grad(set_to_none=True)
    total = 0.0
    for x, y in zip(inputs.tensor_split(num_microbatches), targets.tensor_split(num_microbatches), strict=True):
        value = loss(model(x), y) / num_microbatches
        value.backward()
        total += float(value.detach())
    return [part_grads(part) for part in model], total


def part_grads(module: nn.Module) -> list[torch.Tensor]:
    """The gradients of one part's parameters (zeros where a gradient is missing)."""
    return [p.grad.detach().clone() if p.grad is not None else torch.zeros_like(p) for p in module.parameters()]


def max_rel_error(got: list[torch.Tensor], want: list[torch.Tensor]) -> float:
    """max |got - want| / max(|want|, tiny) over all tensors of a part."""
    return max((float((g - w).abs().max()) / max(float(w.abs().max()), 1e-12) for g, w in zip(got, want, strict=True)),
               default=0.0)


Loss = Callable[..., torch.Tensor]
TORCH_SCHEDULES: Mapping[str, tuple[str, str]] = MappingProxyType({
    "1f1b": ("Schedule1F1B", "linear"), "gpipe": ("ScheduleGPipe", "linear"),
    "interleaved-1f1b": ("ScheduleInterleaved1F1B", "looped"), "zbv": ("ScheduleZBVZeroBubble", "v"),
    "dualpipev": ("ScheduleDualPipeV", "v")})  # schedule key -> (torch schedule class name, placement of its stages)


def frozen_sgd(params: list[nn.Parameter]) -> torch.optim.Optimizer:
    """SGD at learning rate 0: both sides step an optimizer, the weights stay as the reference's."""
    return torch.optim.SGD(params, lr=0.0)


def group_grads(modules: dict[int, nn.Module], schedule: Schedule) -> dict[int, list[torch.Tensor]]:
    """This rank's gradients by weight group (model part), the copies of a group summed."""
    out: dict[int, list[torch.Tensor]] = {}
    for stage, module in modules.items():
        grads, group = part_grads(module), schedule.stages[stage].group
        out[group] = [a + b for a, b in zip(out[group], grads, strict=True)] if group in out else grads
    return out


@dataclass
class OursPipe:
    """One rank's bare duplexpipe runtime; its step zeroes the gradients, then runs the schedule."""

    schedule: Schedule  # the compute-only (or lowered) schedule the runtime executes
    modules: dict[int, nn.Module]  # stage index -> this rank's copy of that stage's model part
    runtime: PipelineRuntime  # the interpreter for this rank's list
    has_first: bool  # true when this rank feeds the model input
    has_last: bool  # true when this rank computes the loss
    last: Any = None  # the latest step's StepResult

    def step(self, inputs: torch.Tensor, targets: torch.Tensor) -> Any:
        """One step over the whole batch (the runtime splits it into microbatches)."""
        for module in self.modules.values():
            module.zero_grad(set_to_none=True)
        self.last = self.runtime.step(inputs if self.has_first else None, targets if self.has_last else None)
        return self.last


def build_ours(name: str, parts: list[nn.Module], rank: int, num_ranks: int, num_microbatches: int,
               schedule: Schedule | None = None, loss: Loss = loss_fn, **config: Any) -> OursPipe:
    """Schedule `name` (or `schedule`) and a runtime (RuntimeConfig(**config)) over this rank's copies of `parts`."""
    sched = schedule if schedule is not None else build_schedule(name, num_ranks, num_microbatches)
    if sched.num_groups != len(parts):
        raise ValueError(f"{name} has {sched.num_groups} model parts, got {len(parts)} parts")
    modules = {s: copy.deepcopy(parts[sched.stages[s].group]) for s in sched.stages_of_rank(rank)}
    runtime = PipelineRuntime(sched, modules, loss, config=RuntimeConfig(**config))
    return OursPipe(sched, modules, runtime, any(sched.is_first(s) for s in modules),
                    any(sched.is_last(s) for s in modules))


def build_pipeline(name: str, parts: list[nn.Module], num_microbatches: int, loss: Loss = loss_fn,
                   **config: Any) -> Pipeline:
    """A Pipeline over `parts` with the default PipelineConfig (plus `config`), trained with `frozen_sgd`."""
    return Pipeline(parts, loss, frozen_sgd, PipelineConfig(schedule=name, num_microbatches=num_microbatches, **config))


def num_stages(key: str, num_ranks: int) -> int:
    """How many stages (model parts) torch's schedule `key` has on `num_ranks` ranks."""
    return num_ranks if TORCH_SCHEDULES[key][1] == "linear" else 2 * num_ranks


@dataclass
class TorchPipe:
    """One rank's torch pipeline: its stage modules, the schedule object and the optimizer over them."""

    modules: dict[int, nn.Module]  # stage index -> this rank's copy of that model part
    schedule: Any  # the torch schedule instance
    has_first: bool  # true when this rank feeds the model input
    has_last: bool  # true when this rank computes the loss
    optimizer: torch.optim.Optimizer  # zeroed before the schedule and stepped after it: a training step

    def step(self, inputs: torch.Tensor, targets: torch.Tensor) -> list[torch.Tensor]:
        """One training step over the whole batch; returns the per-microbatch losses held here."""
        self.optimizer.zero_grad(set_to_none=True)
        losses: list[torch.Tensor] = []
        self.schedule.step(*((inputs,) if self.has_first else ()), target=targets if self.has_last else None,
                           losses=losses, return_outputs=False)
        self.optimizer.step()
        return losses


def build_torch_pipe(key: str, parts: list[nn.Module], rank: int, num_ranks: int, num_microbatches: int,
                     loss: Loss = loss_fn) -> TorchPipe:
    """This rank's parts as PipelineStages under torch's schedule `key`, trained with `frozen_sgd`."""
    if key not in TORCH_SCHEDULES:
        raise ValueError(f"no torch schedule for {key!r}; known: {sorted(TORCH_SCHEDULES)}")
    cls_name, placement = TORCH_SCHEDULES[key]
    total = num_stages(key, num_ranks)
    if len(parts) != total:
        raise ValueError(f"{key} on {num_ranks} ranks needs {total} parts, got {len(parts)}")
    local = {"linear": [rank], "looped": [rank, rank + num_ranks], "v": [rank, 2 * num_ranks - 1 - rank]}[placement]
    modules = {s: copy.deepcopy(parts[s]) for s in local}
    stages = [pp.PipelineStage(modules[s], s, total, torch.device("cpu")) for s in local]
    schedule = getattr(pp, cls_name)(stages[0] if placement == "linear" else stages, num_microbatches, loss_fn=loss,
                                     scale_grads=True)
    return TorchPipe(modules, schedule, 0 in local, total - 1 in local,
                     frozen_sgd([p for s in local for p in modules[s].parameters()]))


def moe_lm_task(dim: int = 64, layers: int = 8, experts: int = 8, seq: int = 32, seed: int = 0) -> Any:
    """A small MoE language model as a `duplexpipe train` task (`benchmarks.models:moe_lm_task`): `layers` blocks of
    causal attention (4 heads) + an MoE layer of `experts` experts (top-2, one shared expert, a sigmoid router),
    character-level on the bundled corpus, `seq` characters per sample."""
    import torch.nn.functional as F

    from duplexpipe import TrainTask
    from duplexpipe.launch.tasks.gpt import CharCorpus
    from duplexpipe.moe import CausalSelfAttention, MoEBlock, MoELayer

    torch.manual_seed(seed)
    corpus = CharCorpus()
    blocks = [MoEBlock(dim, MoELayer(dim, dim, experts, 2, shared_experts=1, router="sigmoid"),
                       mixer=CausalSelfAttention(dim, 4)) for _ in range(layers)]

    def loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))

    return TrainTask(layers=blocks, loss_fn=loss, batch=lambda step, size: corpus.batch(step, size, seq),
                     embedding=nn.Embedding(corpus.vocab_size, dim),
                     head=nn.Sequential(nn.LayerNorm(dim), nn.Linear(dim, corpus.vocab_size)),
                     items_per_sample=seq, item_name="tokens")
