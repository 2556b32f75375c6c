"""Measure model parts: forward, input-gradient and weight-gradient time, saved activation bytes, message bytes."""

from __future__ import annotations

import glob
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import Tensor, nn
from torch.autograd.graph import get_gradient_edge

from duplexpipe.model.stages import selective_context
from duplexpipe.planner.profile import PartProfile, Profile
from duplexpipe.runtime.backward.checkpoint import RecomputeWatch, checkpoint
from duplexpipe.runtime.backward.graph import stage_backward_input, stage_backward_weight
from duplexpipe.runtime.saved_bytes import SavedBytes, storage_key
from duplexpipe.runtime.structure import Form, call, flatten
from duplexpipe.tp.facts import tp_degrees, tp_facts
from duplexpipe.tp.plans import TPPlan

Timer = Callable[[], float]
"""Returns the current time in seconds (time.perf_counter by default; tests inject a scripted one)."""


def tensor_leaves(value: Any) -> list[Tensor]:
    """The tensors of a message: a tensor, or a tuple / list / dict of them (nested), in order."""
    if isinstance(value, Tensor):
        return [value]
    if isinstance(value, (tuple, list)):
        return [t for item in value for t in tensor_leaves(item)]
    if isinstance(value, dict):
        return [t for key in value for t in tensor_leaves(value[key])]
    return []


def nbytes(tensors: Sequence[Tensor]) -> int:
    """Bytes of the tensors' elements."""
    return sum(t.numel() * t.element_size() for t in tensors)


def _sync(tensors: Sequence[Tensor]) -> None:
    """Wait for the device, so the timer sees finished work (a no-op on CPU)."""
    if any(t.is_cuda for t in tensors) and torch.cuda.is_available():
        torch.cuda.synchronize()


@dataclass
class _Message:
    """What flows into a part, as the runtime hands it over: the structure's form, its leaves, and
    which leaves carry a gradient back (floating tensors that required grad where produced)."""

    form: Form
    leaves: list[Tensor]
    grads: list[bool]

    @staticmethod
    def of(value: Any, what: str, grads: bool) -> _Message:
        form, leaves = flatten(value, what)
        return _Message(form, leaves, [grads and t.requires_grad for t in leaves])


class _PartRun:
    """One part's measured F, I and W (and what its forward saved) over repeated runs."""

    def __init__(self, part: nn.Module, timer: Timer, fused: bool, evict: Tensor | None) -> None:
        self.part, self.timer, self.fused, self.evict = part, timer, fused, evict
        self.params = [p for p in part.parameters() if p.requires_grad]
        self.meter = SavedBytes(part.parameters())
        self.times: tuple[list[float], ...] = ([], [], [], [])
        self.saved = 0
        self.selective_backward: list[float] = []
        self.selective_saved = 0
        self.selective_held = 0

    def once(self, message: _Message, loss: Callable[[Any], Tensor] | None, data: list[Tensor]) -> Any:
        """F, I and W on `message` (called as the runtime calls a stage); returns the output."""
        inputs = [t.detach().requires_grad_(g) for t, g in zip(message.leaves, message.grads, strict=True)]
        leaves = [t for t in inputs if t.requires_grad]
        self.meter.start(kept=leaves, data=data)
        _sync(inputs)
        start = self._cool(None)
        with self.meter.counting():
            out = call(self.part, message.form, inputs)
            root_values = _roots(out, loss)
        _sync(tensor_leaves(out))
        mid = self.timer()
        i_start = self._cool(mid)
        self.saved = self.meter.total
        if not root_values:
            raise ValueError(f"{type(self.part).__name__}: no output requires grad, so no backward can be "
                             "profiled (are all parameters frozen?)")
        i_s, w_s = self._backward(root_values, leaves, out, i_start)
        for bucket, value in zip(self.times, (mid - start, i_s, w_s), strict=False):
            bucket.append(value)
        self.part.zero_grad(set_to_none=True)
        if self.fused:
            self.times[3].append(self._fused(message, loss, data))
        return out

    def selective(self, message: _Message, loss: Callable[[Any], Tensor] | None, data: list[Tensor]) -> Any:
        """F under selective checkpointing (the runtime's policy, `selective_context`), then I and W (timed together:
        the recompute runs in I, or in W for a part whose input takes no gradient), the clock read as `once` reads
        it; returns the output. Keeps the bytes the forward saved (the policy's saved outputs and the input leaves,
        counted by the `SavedBytes` rule) and the most the part held once its recompute ran (what the backward needs,
        what the policy's cache still keeps, and what the forward saved outside it; parameters excluded)."""
        inputs = [t.detach().requires_grad_(g) for t, g in zip(message.leaves, message.grads, strict=True)]
        leaves = [t for t in inputs if t.requires_grad]
        self.meter.start(kept=leaves, data=data)
        cache: dict[int, int] = {}
        outside: dict[int, int] = {}
        never = {storage_key(t)[0] for t in (*self.part.parameters(), *data)}  # as the meter: weights, the batch

        def keep(output: Any) -> None:
            self.meter.keep(tensor_leaves(output))
            cache.update(storage_key(t) for t in tensor_leaves(output))

        def recomputed() -> None:
            held = {**outside, **{a: n for a, n in map(storage_key, watch.held()) if a not in never}}
            self.selective_held = max(self.selective_held, sum(held.values()))

        def run(*args: Tensor) -> Any:
            return call(self.part, message.form, list(args))

        watch = RecomputeWatch(on_recompute=recomputed)
        _sync(inputs)
        self._cool(None)  # read as `once` reads it: the clock keeps its cadence of four reads a run
        with self.meter.counting(), watch.collecting():
            out = checkpoint(run, *inputs, context_fn=lambda: selective_context(keep))
            roots = _roots(out, loss)
        _sync(tensor_leaves(out))
        mid = self.timer()
        i_start = self._cool(mid)
        self.selective_saved = self.meter.total
        self.selective_held = self.selective_saved
        outside.update((a, n) for a, n in self.meter.storages.items() if a not in cache)
        self.selective_backward.append(sum(self._backward(roots, leaves, out, i_start)))
        self.part.zero_grad(set_to_none=True)
        return out

    def _backward(self, roots: list[Tensor], leaves: list[Tensor], out: Any, i_start: float) -> tuple[float, float]:
        """I then W from `roots` (ones as their gradients), each timed (I from `i_start`, W after a cool-down);
        (I seconds, W seconds)."""
        _, work = stage_backward_input([get_gradient_edge(r) for r in roots], [torch.ones_like(r) for r in roots],
                                       leaves, self.params)
        _sync(leaves or tensor_leaves(out))
        after_i = self.timer()
        w_start = self._cool(after_i)
        stage_backward_weight(work)
        _sync(self.params)
        return after_i - i_start, self.timer() - w_start

    def _cool(self, now: float | None) -> float:
        """Write the eviction buffer (if any), so the next pass finds the caches cold as in a pipeline,
        and return the time after it (`now` when there is nothing to write and `now` is known)."""
        if self.evict is None:
            return self.timer() if now is None else now
        self.evict.add_(1.0)
        _sync([self.evict])
        return self.timer()

    def _fused(self, message: _Message, loss: Callable[[Any], Tensor] | None, data: list[Tensor]) -> float:
        """A forward (untimed), then a full backward in one pass, as the runtime runs B; its seconds."""
        inputs = [t.detach().requires_grad_(g) for t, g in zip(message.leaves, message.grads, strict=True)]
        out = call(self.part, message.form, inputs)
        roots = _roots(out, loss)
        grads = [torch.ones_like(r) for r in roots]
        _sync(inputs)
        start = self._cool(None)
        torch.autograd.backward(roots, grads)
        _sync(self.params or inputs)
        took = self.timer() - start
        self.part.zero_grad(set_to_none=True)
        return took

    def result(self, output: Any) -> PartProfile:
        """The fastest of the kept runs (contention only ever adds time), with the bytes of `output`."""
        leaves = tensor_leaves(output)
        f, i, w = (min(ts) for ts in self.times[:3])
        grad_leaves = [t for t in leaves if t.requires_grad]
        return PartProfile(f, i, w, self.saved, nbytes(list(self.part.parameters())), nbytes(leaves),
                           nbytes(grad_leaves), backward_fused_s=min(self.times[3]) if self.fused else None)


def profile_parts(parts: Sequence[nn.Module], sample_input: Any, *, target: Any = None,
                  loss_fn: Callable[[Any, Any], Tensor] | None = None, repeats: int = 3, warmup: int = 1,
                  microbatch_size: int | None = None, fit_rows: int | None = None, fused: bool = True,
                  evict_bytes: int = 0, timer: Timer = time.perf_counter,
                  meta: dict[str, Any] | None = None, tp_plan: TPPlan | None = None,
                  selective: bool = True) -> Profile:
    """Measure each part on one microbatch, the parts run in order so each sees its real input.

    Per part: the fastest of `repeats` runs (after `warmup` unmeasured ones; run round by round
    over all parts, so a slow moment of the machine does not hit one part's runs only), separately for
    its forward, its input-gradient backward (I) and its weight-gradient backward (W), split as
    the runtime splits them; the bytes its forward keeps for backward (`SavedBytes`: what
    autograd saves plus the input leaves kept for I, each storage once, parameters and the
    sample's own tensors excluded, the rule the runtime's `StepResult.peak_saved_bytes` uses);
    its parameter bytes; and the bytes of every tensor of its output (the forward message) and
    of those that take gradients (the gradient message). Parts are called as the runtime calls
    stages (a tuple/list message as positional arguments, a dict as keyword arguments), the
    first one on inputs that take no gradient. The last part's backward starts from
    `loss_fn(output, target)` when a loss is given, every other from a gradient of ones. `microbatch_size` (default:
    the first dimension of the first tensor of `sample_input`) is recorded for scaling.

    Affine fit: the parts are timed again on the first `fit_rows` rows of the sample (and
    target; default half of them, 0 for no fit), and each pass's time is split into a fixed
    part and a part proportional to the rows (`PartProfile.forward_fixed_s` etc.), the fixed
    part clamped to [0, time]. `fused`: also time a full backward in one pass after an untimed
    forward (`PartProfile.backward_fused_s`, what a B action costs; I + W traverse the graph twice).
    `evict_bytes`: before each timed pass write a buffer of that many bytes (on the sample's
    device), so the pass starts with the part's data out of the core's private caches, as in a
    pipeline, where other microbatches, parts and processes run between a part's passes (warm
    timings of a part run back to back can be 1.5x faster than in the runtime; `cache_evict_bytes()`
    gives twice this machine's L2). Gradients are cleared afterwards.

    `tp_plan`: the model's tensor-parallel plan (a dict, or a plan that names its styles, e.g. `HFTensorPlan`): each
    part's `PartProfile.tp` (`tp.facts`: the collectives a TP rank issues, with the bytes of the whole
    activations of this forward, and the parameters the plan leaves whole) and `Profile.tp_degrees`, what the planner
    needs to plan T > 1. The parts themselves are profiled whole.

    `selective`: afterwards run each part again under the runtime's selective checkpointing (`repeats` runs after
    `warmup`, the clock read as for F, I and W): the bytes its forward saves under the policy and how much longer
    its backward takes with the recompute (`PartProfile.selective_activation_bytes`, `selective_recompute_s`, what the
    planner weighs selective checkpointing with); a part the policy cannot run leaves them unset for every part
    (the reason in `meta["selective_error"]`).
    """
    if not parts:
        raise ValueError("profile_parts needs at least one part, got none")
    if repeats < 1 or warmup < 0:
        raise ValueError(f"profile_parts needs repeats >= 1 and warmup >= 0, got repeats={repeats}, "
                         f"warmup={warmup}")
    rows = _rows(sample_input) if fit_rows != 0 or microbatch_size is None else 0
    size = microbatch_size if microbatch_size is not None else rows
    small = rows // 2 if fit_rows is None else fit_rows
    if evict_bytes < 0:
        raise ValueError(f"profile_parts needs evict_bytes >= 0, got {evict_bytes}")
    if fit_rows is not None and fit_rows != 0 and not 1 <= fit_rows < rows:
        raise ValueError(f"profile_parts needs 1 <= fit_rows < the sample's {rows} rows (or 0: no fit), "
                         f"got fit_rows={fit_rows}")
    leaves = tensor_leaves(sample_input)
    evict = torch.zeros(evict_bytes // 4, device=leaves[0].device if leaves else None) if evict_bytes else None
    facts = dict(meta or {}, repeats=repeats, warmup=warmup, fit_rows=max(small, 0), evict_bytes=evict_bytes,
                 torch=torch.__version__)
    measured = _measure(parts, sample_input, target, loss_fn, (repeats, warmup, fused), timer, evict,
                        facts if selective else None)
    if small >= 1:
        fewer = _measure(parts, _head(sample_input, small, rows), _head(target, small, rows), loss_fn,
                         (repeats, warmup, fused), timer, evict)
        measured = [_affine(full, part, rows, small) for full, part in zip(measured, fewer, strict=True)]
    return _with_tp(Profile(tuple(measured), size, facts), parts, sample_input, tp_plan)


def _with_tp(profile: Profile, parts: Sequence[nn.Module], sample_input: Any, plan: TPPlan | None) -> Profile:
    """`profile` with what `plan` does to each part and the degrees it can shard them with (`tp.facts`);
    unchanged without a plan or with a callable plan that cannot name its styles."""
    facts = tp_facts(parts, sample_input, plan) if plan is not None else None
    if facts is None or plan is None:
        return profile
    return replace(profile, parts=tuple(replace(p, tp=f) for p, f in zip(profile.parts, facts, strict=True)),
                   tp_degrees=tp_degrees(parts, plan))


def _measure(parts: Sequence[nn.Module], sample_input: Any, target: Any,
             loss_fn: Callable[[Any, Any], Tensor] | None, runs: tuple[int, int, bool],
             timer: Timer, evict: Tensor | None, selective: dict[str, Any] | None = None) -> list[PartProfile]:
    """Each part's fastest F, I and W (and fused B) and its bytes, the parts run in order on `sample_input`;
    `runs`: (repeats, warmup, fused). `selective` (a profile's meta, or None for none): each round then runs the
    parts again under selective checkpointing (`_PartRun.selective`), so both see the same moments of the machine;
    a part the policy cannot run (RuntimeError) leaves the figures unset, its reason in `selective_error`."""
    repeats, warmup, fused = runs
    first = _Message.of(sample_input, "sample_input", grads=False)  # a first stage's input takes no gradient
    data = list(first.leaves) + tensor_leaves(target)  # the caller's batch: never counted
    timed = [_PartRun(part, timer, fused, evict) for part in parts]
    outputs: list[Any] = [None] * len(parts)
    for attempt in range(warmup + repeats):  # round by round over the parts: a slow moment hits all alike
        message = first
        for k, run in enumerate(timed):
            last = k == len(parts) - 1
            loss = (lambda out: loss_fn(out, target)) if last and loss_fn is not None else None  # noqa: E731
            outputs[k] = run.once(message, loss, data)
            if attempt < warmup:
                run.times = ([], [], [], [])
            message = _Message.of(outputs[k], f"the output of part {k}", grads=True)
            message.leaves = [t.detach() for t in message.leaves]  # keep the values, free the graph
        if selective is not None and "selective_error" not in selective:
            try:
                _selective_round(timed, first, target, loss_fn, data, attempt < warmup)
            except RuntimeError as exc:  # an operator the selective policy cannot recompute: the lever is not planned
                selective["selective_error"] = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
    out = [run.result(o) for run, o in zip(timed, outputs, strict=True)]
    if selective is None or "selective_error" in selective:
        return out
    return [replace(p, selective_activation_bytes=run.selective_saved, selective_held_bytes=run.selective_held,
                    selective_recompute_s=max(0.0, min(run.selective_backward) - p.backward_s))
            for p, run in zip(out, timed, strict=True)]


def _selective_round(timed: Sequence[_PartRun], first: _Message, target: Any,
                     loss_fn: Callable[[Any, Any], Tensor] | None, data: list[Tensor], warm: bool) -> None:
    """One round of the parts in order under selective checkpointing (`warm`: a warm-up round, not kept)."""
    message = first
    for k, run in enumerate(timed):
        last = k == len(timed) - 1
        loss = (lambda out: loss_fn(out, target)) if last and loss_fn is not None else None  # noqa: E731
        output = run.selective(message, loss, data)
        if warm:
            run.selective_backward = []
        message = _Message.of(output, f"the output of part {k}", grads=True)
        message.leaves = [t.detach() for t in message.leaves]


def _affine(full: PartProfile, fewer: PartProfile, rows: int, small: int) -> PartProfile:
    """`full` with each pass's fixed part from its times on `rows` and on `small` rows."""
    def fixed(big: float, little: float) -> float:
        return min(max((rows * little - small * big) / (rows - small), 0.0), big)
    f, i, w = (fixed(big, little) for big, little in zip(full.times, fewer.times, strict=True))
    fused = None
    if full.backward_fused_s is not None and fewer.backward_fused_s is not None:
        fused = fixed(full.backward_fused_s, fewer.backward_fused_s)
    return replace(full, forward_fixed_s=f, backward_input_fixed_s=i, backward_weight_fixed_s=w,
                   backward_fused_fixed_s=fused)


def _head(value: Any, count: int, rows: int) -> Any:
    """`value` with every tensor of `rows` rows cut to its first `count` (others, and non-tensors, kept)."""
    if isinstance(value, Tensor):
        return value[:count] if value.dim() >= 1 and value.shape[0] == rows else value
    if isinstance(value, tuple):
        return tuple(_head(v, count, rows) for v in value)
    if isinstance(value, list):
        return [_head(v, count, rows) for v in value]
    if isinstance(value, dict):
        return {k: _head(v, count, rows) for k, v in value.items()}
    return value


def cache_evict_bytes(default: int = 8 * 2**20) -> int:
    """Twice the largest per-core cache (L1/L2, from Linux sysfs), or `default` where it is not readable."""
    sizes = []
    for index in glob.glob("/sys/devices/system/cpu/cpu0/cache/index*"):
        try:
            with open(os.path.join(index, "shared_cpu_list"), encoding="utf-8") as fh:
                shared = fh.read().strip()
            with open(os.path.join(index, "size"), encoding="utf-8") as fh:
                text = fh.read().strip()
        except OSError:
            continue
        if "," in shared or "-" in shared:  # shared by several cores (L3): not evicted
            continue
        unit = {"K": 2**10, "M": 2**20, "G": 2**30}.get(text[-1:].upper(), 1)
        digits = text.rstrip("KMGkmg")
        if digits.isdigit():
            sizes.append(int(digits) * unit)
    return 2 * max(sizes) if sizes else default


def _roots(out: Any, loss: Callable[[Any], Tensor] | None) -> list[Tensor]:
    """Where a part's backward starts: its loss (the last part, given one), else its outputs that take gradients."""
    return [loss(out)] if loss is not None else [t for t in tensor_leaves(out) if t.requires_grad]


def _rows(sample: Any) -> int:
    leaves = tensor_leaves(sample)
    if not leaves or leaves[0].dim() == 0:
        raise ValueError("profile_parts cannot tell the microbatch size from sample_input; pass microbatch_size=")
    return int(leaves[0].shape[0])
