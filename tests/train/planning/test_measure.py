"""profile_parts: the I/W-split timing arithmetic (with a scripted timer), saved and message bytes, loss."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from torch import Tensor, nn

from duplexpipe.train.planning.measure import cache_evict_bytes, nbytes, profile_parts, tensor_leaves


class ScriptedTimer:
    """A clock that advances by scripted (F, I, W) durations: four reads per measured run of a part."""

    def __init__(self, runs: list[tuple[float, float, float]]) -> None:
        self.reads: list[float] = []
        now = 0.0
        for f, i, w in runs:
            self.reads += [now, now + f, now + f + i, now + f + i + w]
            now += f + i + w + 1.0
        self.reads.reverse()

    def __call__(self) -> float:
        return self.reads.pop()


def mlp(width: int = 8) -> nn.Module:
    return nn.Sequential(nn.Linear(width, width), nn.ReLU())


def test_the_fastest_measured_run_of_each_pass_after_warmup() -> None:
    torch.manual_seed(0)
    parts = [mlp(), mlp()]
    # round by round over the parts: a warm-up round (discarded), then three rounds; each round runs the parts
    # again under selective checkpointing (I + W with the recompute)
    timer = ScriptedTimer([(50, 50, 50), (60, 60, 60), (50, 50, 50), (60, 60, 60),
                           (1, 4, 7), (0.5, 0.1, 0.2), (1, 5, 7), (0.5, 0.3, 0.2),
                           (3, 5, 9), (0.4, 0.3, 0.1), (1, 4.5, 7), (0.4, 0.2, 0.1),
                           (2, 6, 8), (0.6, 0.2, 0.3), (1, 6, 7), (0.6, 0.25, 0.3)])
    profile = profile_parts(parts, torch.randn(4, 8), repeats=3, warmup=1, fit_rows=0, fused=False, timer=timer)
    assert not timer.reads, "four timer reads per run"
    p0, p1 = profile.parts
    assert (p0.forward_s, p0.backward_input_s, p0.backward_weight_s) == (1, 4, 7)
    assert (p1.forward_s, p1.backward_input_s, p1.backward_weight_s) == pytest.approx((0.4, 0.1, 0.1))
    assert (p0.selective_recompute_s, p1.selective_recompute_s) == pytest.approx((0.5, 0.1))
    assert profile.microbatch_size == 4 and profile.meta["repeats"] == 3 and profile.meta["warmup"] == 1


def test_the_affine_fit_splits_each_pass_into_fixed_and_per_row_time() -> None:
    torch.manual_seed(0)
    # 4 rows, then the first 1 row; times t = fixed + rows x per_row with known parts
    fixed, per_row = (0.4, 0.2, 0.1), (0.5, 1.0, 0.25)
    full = tuple(c + 4 * r for c, r in zip(fixed, per_row, strict=True))
    one = tuple(c + 1 * r for c, r in zip(fixed, per_row, strict=True))
    timer = ScriptedTimer([full, full, one, one])  # warm-up + run on 4 rows, then on 1 row
    profile = profile_parts([mlp()], torch.randn(4, 8), repeats=1, warmup=1, fit_rows=1, fused=False, timer=timer,
                            selective=False)
    (p,) = profile.parts
    assert p.fixed == pytest.approx(fixed) and profile.meta["fit_rows"] == 1
    assert p.scaled(2.0).times == pytest.approx(tuple(c + 8 * r for c, r in zip(fixed, per_row, strict=True)))
    # one part slower on fewer rows (noise): its fixed part is clamped to the whole time
    timer = ScriptedTimer([(1.0, 1.0, 1.0)] * 2 + [(2.0, 0.1, 1.0)] * 2)
    (q,) = profile_parts([mlp()], torch.randn(4, 8), repeats=1, warmup=1, fit_rows=2, fused=False, timer=timer,
                         selective=False).parts
    assert q.fixed == pytest.approx((1.0, 0.0, 1.0))
    for bad in (4, 5, -1):
        with pytest.raises(ValueError, match="fit_rows"):
            profile_parts([mlp()], torch.randn(4, 8), fit_rows=bad)


class ListTimer:
    """Returns the given readings in order."""

    def __init__(self, reads: list[float]) -> None:
        self.reads = list(reversed(reads))

    def __call__(self) -> float:
        return self.reads.pop()


def test_the_fused_backward_is_timed_as_the_runtime_runs_b() -> None:
    # per run: F, I, W (four reads), then a fused B (two reads); warm-up discarded, the fastest kept
    runs = [(9, 9, 9, 9), (1, 2, 3, 4.0), (1, 2, 3, 3.5)]
    reads: list[float] = []
    for f, i, w, b in runs:
        reads += [0.0, f, f + i, f + i + w, 100.0, 100.0 + b]
    timer = ListTimer(reads)
    (p,) = profile_parts([mlp()], torch.randn(4, 8), repeats=2, warmup=1, fit_rows=0, timer=timer,
                         selective=False).parts
    assert not timer.reads and (p.forward_s, p.backward_s, p.backward_fused_s) == (1, 5, 3.5)
    assert p.full_backward_s == 3.5 and p.linear().full_backward_s == 5
    real = profile_parts([mlp()], torch.randn(4, 8), repeats=1, warmup=0).parts[0]
    assert real.backward_fused_s is not None and real.backward_fused_fixed_s is not None


def test_cold_cache_timing_writes_a_buffer_between_passes_outside_the_timings() -> None:
    # with eviction every pass has its own two reads (the buffer is written between them, untimed)
    reads = [0.0, 1.0, 5.0, 7.0, 20.0, 23.0,  # warm-up: F, I, W
             100.0, 101.5, 110.0, 112.0, 120.0, 120.5,  # F 1.5, I 2, W 0.5
             200.0, 204.0]  # the fused B: 4
    timer = ListTimer(reads)
    (p,) = profile_parts([mlp()], torch.randn(4, 8), repeats=1, warmup=1, fit_rows=0, fused=False,
                         evict_bytes=1 << 16, timer=timer, selective=False).parts
    assert (p.forward_s, p.backward_input_s, p.backward_weight_s) == (1.5, 2.0, 0.5) and len(timer.reads) == 2
    assert cache_evict_bytes() > 0 and cache_evict_bytes(default=7) in (7, cache_evict_bytes())
    with pytest.raises(ValueError, match="evict_bytes >= 0"):
        profile_parts([mlp()], torch.randn(4, 8), evict_bytes=-1)
    real = profile_parts([mlp()], torch.randn(4, 8), repeats=1, warmup=0, evict_bytes=1 << 16)
    assert real.meta["evict_bytes"] == 1 << 16 and real.parts[0].backward_fused_s is not None


def test_bytes_of_activations_parameters_and_messages() -> None:
    profile = profile_parts([mlp(), mlp()], torch.randn(4, 8), repeats=1, warmup=0)
    first, second = profile.parts
    assert first.activation_bytes == 4 * 8 * 4  # ReLU's output; the sample (Linear's input) is the caller's
    assert second.activation_bytes == 2 * 4 * 8 * 4  # its input leaf (kept for I, saved by Linear) and ReLU's
    for part in profile.parts:
        assert part.param_bytes == (8 * 8 + 8) * 4
        assert part.output_bytes == part.output_grad_bytes == 4 * 8 * 4
        assert part.forward_s >= 0 and part.backward_input_s >= 0 and part.backward_weight_s >= 0


class Split(nn.Module):
    """Returns a dict message: a float tensor and an integer mask (which takes no gradient)."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Linear(8, 8)

    def forward(self, x: Tensor) -> dict[str, Tensor]:
        return {"h": self.layer(x), "mask": torch.ones(x.shape[0], 3, dtype=torch.int64)}


class Join(nn.Module):
    """Called as the runtime calls a stage on a dict message: with keyword arguments."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Linear(8, 2)

    def forward(self, h: Tensor, mask: Tensor) -> Tensor:
        return self.layer(h) + mask.sum()


class Scale(nn.Module):
    """Multiplies by a weight: saves its input, nothing else (the input of a later part is kept anyway)."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.ones(8))

    def forward(self, x: Tensor) -> Tensor:
        return x * self.w


class Shift(nn.Module):
    """Adds a weight: autograd saves nothing; the input leaf is still kept until its I."""

    def __init__(self) -> None:
        super().__init__()
        self.b = nn.Parameter(torch.zeros(8))

    def forward(self, x: Tensor) -> Tensor:
        return x + self.b


def test_kept_input_leaves_count_once_and_the_sample_never() -> None:
    profile = profile_parts([Scale(), Shift(), Scale()], torch.randn(4, 8), repeats=1, warmup=0)
    first, shift, last = (p.activation_bytes for p in profile.parts)
    assert first == 0  # it saves only the sample, which is the caller's
    assert shift == 4 * 8 * 4  # nothing saved by autograd, but the input leaf is kept for I
    assert last == 4 * 8 * 4  # the kept input leaf is the tensor it saves: counted once


def test_structured_messages_and_a_loss_on_the_last_part() -> None:
    parts = [Split(), Join()]
    target = torch.randn(4, 2)
    profile = profile_parts(parts, torch.randn(4, 8), target=target, loss_fn=nn.functional.mse_loss,
                            repeats=1, warmup=0)
    first, last = profile.parts
    assert first.output_bytes == 4 * 8 * 4 + 4 * 3 * 8 and first.output_grad_bytes == 4 * 8 * 4
    assert first.activation_bytes == 0  # Linear saves only the sample
    # its input h (kept, saved by Linear) and what mse saves of the output; the target is the caller's
    assert last.activation_bytes == 4 * 8 * 4 + 4 * 2 * 4
    assert all(p.grad is None for part in parts for p in part.parameters()), "gradients are cleared"


def test_leaves_and_bad_arguments() -> None:
    a, b = torch.zeros(2), torch.zeros(3, dtype=torch.float16)
    assert tensor_leaves({"x": [a, (b,)], "n": 3}) == [a, b] and nbytes([a, b]) == 8 + 6
    with pytest.raises(ValueError, match="at least one part"):
        profile_parts([], torch.zeros(2, 8))
    with pytest.raises(ValueError, match="repeats >= 1 and warmup >= 0"):
        profile_parts([mlp()], torch.zeros(2, 8), repeats=0)
    frozen = nn.Embedding(10, 4).requires_grad_(False)
    with pytest.raises(ValueError, match="no output requires grad"):
        profile_parts([frozen], torch.zeros(2, 3, dtype=torch.int64))
    with pytest.raises(ValueError, match="cannot tell the microbatch size"):
        profile_parts([mlp()], torch.tensor(1.0))


class Block(nn.Module):
    """A transformer-like MLP block: norm, up-projection, GELU, down-projection, residual."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm, self.up, self.down = nn.LayerNorm(width), nn.Linear(width, 4 * width), nn.Linear(4 * width, width)

    def forward(self, x: Tensor) -> Tensor:
        return x + self.down(nn.functional.gelu(self.up(self.norm(x))))


def test_selective_checkpointing_is_measured_on_the_real_part_and_planned_from_it() -> None:
    """Under the runtime's selective policy a block keeps its matmuls' outputs (and its input leaf): less than it
    keeps plain (the norm's, GELU's saved tensors), more than full checkpointing (the input alone)."""
    from duplexpipe.planner.levers import checkpointed
    from duplexpipe.planner.plan import PlanConfig, plan

    torch.manual_seed(0)
    width, rows, seq = 16, 4, 8
    profile = profile_parts([Block(width), Block(width)], torch.randn(rows, seq, width), repeats=1, warmup=0,
                            fit_rows=0)
    first, second = profile.parts
    matmuls = rows * seq * (4 * width + width) * 4  # float32 outputs of the up and down projections
    assert first.selective_activation_bytes == matmuls  # its input is the caller's sample: never counted
    assert second.selective_activation_bytes == matmuls + first.output_bytes  # and the input leaf its I keeps
    full = checkpointed(profile.parts)[0][1]
    assert full.activation_bytes < second.selective_activation_bytes < second.activation_bytes
    # once recomputed, a part holds what its backward needs (as plain) and what the policy's cache keeps beside it:
    # the down projection's output, which the residual add never takes
    down = rows * seq * width * 4
    assert (first.selective_held_bytes, second.selective_held_bytes) == \
        (first.activation_bytes + down, second.activation_bytes + down)
    assert second.selective_recompute_s is not None and second.selective_recompute_s >= 0
    assert "selective_error" not in profile.meta
    base = PlanConfig(ranks=2, batch=16, memory=2**40, schedules=("1f1b",), microbatches=(4,))
    alone = plan(profile, replace(base, checkpointing=("selective",))).best
    best = plan(profile, replace(base, memory=int(alone.peak_bytes))).best
    assert best.checkpointing == "selective" and best.peak_bytes == alone.peak_bytes
