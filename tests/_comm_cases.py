"""Worker-side cases for test_comm_reducers.py (reducers, error feedback, meter, wire formats): each returns
plain metrics that the tests assert."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from duplexpipe.comm import Bucket, C10dCounter, Reducer, WireMeter, build_reducer, ring_bytes
from duplexpipe.comm.codec import TensorSpec
from duplexpipe.comm.dgc import dgc_density
from duplexpipe.comm.quantize import (
    INT8_MAX,
    dequantize_fp8,
    dequantize_int8,
    fp8_from_wire,
    fp8_to_wire,
    quantize_fp8,
    quantize_int8,
)
from duplexpipe.comm.sparsify import keep_count, segment_keep_counts
from duplexpipe.dp_options.compression import (
    DGCOptions,
    Int8Options,
    PowerSGDOptions,
    RandomKOptions,
    ThresholdOptions,
    TopKOptions,
)

SHAPES = {0: [(8, 6), (6,), (5, 4)], 5: [(10, 3), (3,)]}
"""Two buckets (indices 0 and 5) with matrices for PowerSGD and vectors it leaves uncompressed."""
NUMEL = {i: sum(torch.Size(s).numel() for s in shapes) for i, shapes in SHAPES.items()}

LOSSY: dict[str, Callable[[], Any]] = {
    "int8": lambda: Int8Options(block=16),
    "topk": lambda: TopKOptions(ratio=0.1),
    "randomk": lambda: RandomKOptions(ratio=0.1, seed=3),
    "threshold": lambda: ThresholdOptions(ratio=0.2, theta=0.3),
    "dgc": lambda: DGCOptions(ratio=0.1, momentum=0.0),
    "powersgd": lambda: PowerSGDOptions(rank=1, start_step=2, min_compression_rate=1.0),
}
"""Methods whose error feedback makes sum(sent) + residual == sum(gradients) (DGC with momentum 0)."""

STATEFUL: dict[str, Callable[[], Any]] = {
    **LOSSY,
    "dgc": lambda: DGCOptions(ratio=0.05, momentum=0.9, clip_norm=5.0, warmup_steps=1),
}


def grad(seed: int, rank: int, step: int, numel: int, dtype: torch.dtype = torch.float64) -> Tensor:
    """Rank `rank`'s gradient at `step`: every rank can regenerate every other rank's."""
    gen = torch.Generator().manual_seed(seed * 1_000_000 + rank * 1000 + step)
    return torch.randn(numel, generator=gen, dtype=torch.float64).to(dtype)


def step(reducer: Reducer, flats: dict[int, Tensor], applied: bool = True) -> dict[int, Tensor]:
    """One step: fresh Bucket objects, all started before any is finished; the means, by bucket index."""
    reductions = []
    for index, flat in flats.items():
        bucket = Bucket(index, SHAPES[index], dtype=flat.dtype)
        bucket.buffer().copy_(flat)
        reductions.append((index, reducer.start(bucket)))
    out = {index: r.finish().clone() for index, r in reductions}
    reducer.end_step(applied)
    return out


def _identical(t: Tensor, group: Any) -> bool:
    """True when every rank of `group` holds the same tensor bit for bit."""
    lo, hi = t.clone(), t.clone()
    dist.all_reduce(lo, op=dist.ReduceOp.MIN, group=group)
    dist.all_reduce(hi, op=dist.ReduceOp.MAX, group=group)
    return bool(torch.equal(lo, t) and torch.equal(hi, t))


def own_group(group: Any) -> Any:
    """A process group over the same ranks as `group`, made by those ranks only (PowerSGD needs its own)."""
    ranks = dist.get_process_group_ranks(group) if group is not None else list(range(dist.get_world_size()))
    return dist.new_group(ranks, use_local_synchronization=True)


def _lossless_inputs(kind: str, rank: int, n: int, numel: int) -> Tensor:
    """Inputs on which `kind`'s compression loses nothing."""
    if kind in ("bf16", "fp16"):  # dyadic values with few bits: x / n and sums are exact in 16 bits
        gen = torch.Generator().manual_seed(rank)
        return torch.randint(-16, 17, (numel,), generator=gen).float() / 8
    if kind == "int8":  # integer codes times 2^-6 with a 127 in every block, ranks' mean integral too
        gen = torch.Generator().manual_seed(99)
        mean = torch.randint(-50, 51, (numel,), generator=gen)
        mean[::16] = 127  # every block's max: scale 2^-6 on every rank and on the owner
        dev = torch.randint(0, 31, (numel,), generator=gen) * (1 - 2 * (rank % 2)) * (1 + rank // 2)
        dev[::16] = 0  # ranks 0,1 (and 2,3) deviate by +-d (+-2d): the deviations sum to 0
        return (mean + dev).float() * 2.0**-6
    return grad(11, rank, 0, numel)


LOSSLESS: dict[str, Callable[[int], Any]] = {
    "none": lambda numel: "none",
    "bf16": lambda numel: "bf16",
    "fp16": lambda numel: "fp16",
    "int8": lambda numel: Int8Options(block=16),
    "topk": lambda numel: TopKOptions(ratio=1.0),
    "randomk": lambda numel: RandomKOptions(ratio=1.0),
    "threshold": lambda numel: ThresholdOptions(ratio=1.0, theta=0.0),
    "dgc": lambda numel: DGCOptions(ratio=1.0, momentum=0.0),
    "powersgd": lambda numel: PowerSGDOptions(rank=10, start_step=2, min_compression_rate=0.01),
}


def lossless_case(group: Any) -> dict[str, float]:
    """Relative error vs the exact mean, per method, on inputs its compression keeps exactly (3 steps:
    PowerSGD compresses from the third; for it rank >= min(rows, cols) of every matrix)."""
    n, rank = dist.get_world_size(group), dist.get_rank(group)
    errors: dict[str, float] = {}
    for kind, make in LOSSLESS.items():
        pg = own_group(group) if kind == "powersgd" else group
        reducer = build_reducer(make(0), pg)
        worst = 0.0
        for s in range(3):
            flats = {i: _lossless_inputs(kind, rank, n, NUMEL[i]) * (s + 1) for i in SHAPES}
            means = {i: sum(_lossless_inputs(kind, r, n, NUMEL[i]).double() * (s + 1) for r in range(n)) / n
                     for i in SHAPES}
            for i, got in step(reducer, flats).items():
                worst = max(worst, float((got.double() - means[i]).abs().max() / means[i].abs().max()))
        errors[kind] = worst
    return errors


def _residual(reducer: Any, kind: str, index: int, numel: int) -> Tensor:
    """This rank's outstanding correction for bucket `index`, in bucket units (see ef_identity_case)."""
    if kind == "powersgd":
        error = reducer.state.error_dict.get(index)
        return torch.zeros(numel, dtype=torch.float64) if error is None else error
    if kind == "int8":
        shard = reducer.shard_size(numel)
        full = torch.zeros(reducer.size * shard, dtype=torch.float64)
        full[reducer.rank * shard:(reducer.rank + 1) * shard] = reducer.owner_residual.get(index) * reducer.size
        return reducer.residual.get(index) + full[:numel]
    if kind == "dgc":
        return reducer.memory.v.get(index)
    return reducer.memory.get(index)


def ef_identity_case(group: Any, steps: int = 6) -> dict[str, dict[str, Any]]:
    """Per lossy method: sum over steps of the means + mean over ranks of the final residual, against the
    mean over ranks of the summed gradients (float64); and whether replicas got identical means."""
    n, rank = dist.get_world_size(group), dist.get_rank(group)
    out: dict[str, dict[str, Any]] = {}
    for kind, make in LOSSY.items():
        reducer = build_reducer(make(), own_group(group) if kind == "powersgd" else group)
        sent = {i: torch.zeros(NUMEL[i], dtype=torch.float64) for i in SHAPES}
        lossy, same = False, True
        for s in range(steps):
            flats = {i: grad(i, rank, s, NUMEL[i]) for i in SHAPES}
            for i, mean in step(reducer, flats).items():
                exact = sum(grad(i, r, s, NUMEL[i]) for r in range(n)) / n
                lossy |= not torch.allclose(mean, exact, rtol=1e-6, atol=1e-6)
                same &= _identical(mean, group)
                sent[i] += mean
        worst = 0.0
        for i in SHAPES:
            residual = _residual(reducer, kind, i, NUMEL[i]).clone()
            dist.all_reduce(residual, group=group)
            want = sum(grad(i, r, s, NUMEL[i]) for r in range(n) for s in range(steps)) / n
            worst = max(worst, float((sent[i] + residual / n - want).abs().max() / want.abs().max()))
        out[kind] = {"err": worst, "lossy": lossy, "identical": same}
    return out


def int8_magnitude_case(group: Any) -> dict[str, float]:
    """Ranks' gradients 1000x apart in magnitude: error / bound for the int8 reducer (<= 1 expected), and
    the same for summing codes under one scale (what the reducer must never do)."""
    n, rank, block, numel = dist.get_world_size(group), dist.get_rank(group), 16, NUMEL[0]
    grads = [grad(3, r, 0, numel, torch.float32) * (1000.0 ** (r % 2)) for r in range(n)]
    reducer = build_reducer(Int8Options(block=block), group)
    got = step(reducer, {0: grads[rank]})[0].double()
    exact = sum(g.double() for g in grads) / n
    blocks = -(-numel // block)

    def per_block(t: Tensor) -> Tensor:
        return torch.cat([t, t.new_zeros(blocks * block - numel)]).view(blocks, block).abs().amax(1)

    local = sum(per_block(g.double()) for g in grads) / (n * INT8_MAX)
    owner = (per_block(exact) + local) / INT8_MAX * (1 + 1e-6)
    bound = torch.repeat_interleave(local * (1 + 1e-6) + owner, block)[:numel]
    codes = [quantize_int8(g, block, None) for g in grads]
    summed = sum(c.int() for c, _ in codes).to(torch.int8).to(torch.float64)  # int8 wrap-around, as on the wire
    garbage = dequantize_int8(summed.to(torch.int8), codes[0][1], block, torch.float64) / n
    return {"ratio": float(((got - exact).abs() / bound).max()),
            "naive_ratio": float(((garbage - exact).abs() / bound).max())}


def rollback_resume_case(group: Any) -> dict[str, dict[str, bool]]:
    """Per stateful method: a rolled-back step leaves no trace (A: g1, g2 skipped, g3 == B: g1, g3), and a
    reducer loaded from A's state_dict continues exactly like A."""
    rank = dist.get_rank(group)
    out: dict[str, dict[str, bool]] = {}
    for kind, make in STATEFUL.items():
        def fresh() -> Reducer:
            return build_reducer(make(), own_group(group) if kind == "powersgd" else group)  # noqa: B023

        def g(s: int) -> dict[int, Tensor]:
            return {i: grad(40 + i, rank, s, NUMEL[i], torch.float32) for i in SHAPES}

        a, b = fresh(), fresh()
        for s in range(3):
            step(a, g(s))
            step(b, g(s))
        step(a, g(3), applied=False)
        a_next, b_next = step(a, g(4)), step(b, g(4))
        loaded = fresh()
        loaded.load_state_dict(a.state_dict())
        a_last, loaded_last = step(a, g(5)), step(loaded, g(5))
        out[kind] = {
            "rollback_exact": all(torch.equal(a_next[i], b_next[i]) for i in SHAPES),
            "resume_exact": all(torch.equal(a_last[i], loaded_last[i]) for i in SHAPES),
        }
    return out


def dgc_warmup_case(group: Any) -> dict[str, Any]:
    """Slots per step of a DGC reducer with warm-up (from the meter), against the paper's schedule."""
    n = dist.get_world_size(group)
    opts = DGCOptions(ratio=0.01, warmup_steps=2)
    reducer = build_reducer(opts, group)
    numel = 4000
    got, want = [], []
    for s in range(10):
        bucket = Bucket(0, [(numel,)])
        bucket.buffer().copy_(grad(5, dist.get_rank(group), s, numel, torch.float32))
        before = reducer.meter.total_bytes
        reducer.start(bucket).finish()
        reducer.end_step(True)
        got.append(reducer.meter.total_bytes - before)
        k = keep_count(numel, dgc_density(s, 0.01, 2))
        want.append(ring_bytes("all_gather", n * k * 8, n))
    return {"got": got, "want": want}


def dgc_per_tensor_case(group: Any) -> dict[str, Any]:
    """A DGC bucket of a matrix, a vector whose gradients are 1000x smaller and a scalar: slots per tensor
    (from the velocity's zeroed positions, the meter and the mean), two steps with momentum."""
    rank, n = dist.get_rank(group), dist.get_world_size(group)
    shapes, ratio = [(40, 25), (200,), ()], 0.01
    numels = [1000, 200, 1]
    reducer = build_reducer(DGCOptions(ratio=ratio, momentum=0.9, selection="tensor"), group)
    zeroed, nonzero, wire = [], [], []
    for s in range(2):
        g = torch.cat([grad(60, rank, s, 1000), grad(61, rank, s, 200) * 1e-3, grad(62, rank, s, 1)])
        bucket = Bucket(0, shapes, dtype=torch.float64)
        bucket.buffer().copy_(g)
        before = reducer.meter.total_bytes
        mean = reducer.start(bucket).finish()
        reducer.end_step(True)
        wire.append(reducer.meter.total_bytes - before)
        v = reducer.memory.v.get(0)
        parts = [v[:1000], v[1000:1200], v[1200:]]
        zeroed.append([int((p == 0).sum()) for p in parts])
        nonzero.append([int((p != 0).sum()) for p in (mean[:1000], mean[1000:1200], mean[1200:])])
    ks = segment_keep_counts(numels, ratio)
    whole = build_reducer(DGCOptions(ratio=ratio, momentum=0.9), group)  # selection "bucket"
    bucket = Bucket(0, shapes, dtype=torch.float64)
    bucket.buffer().copy_(torch.cat([grad(60, rank, 0, 1000), grad(61, rank, 0, 200) * 1e-3, grad(62, rank, 0, 1)]))
    whole.start(bucket).finish()
    whole.end_step(True)
    v = whole.memory.v.get(0)
    return {"ks": ks, "zeroed": zeroed, "nonzero": nonzero, "wire": wire,
            "want_wire": ring_bytes("all_gather", n * sum(ks) * 12, n),
            "bucket_zeroed": [int((p == 0).sum()) for p in (v[:1000], v[1000:1200], v[1200:])],
            "bucket_k": keep_count(1201, ratio)}


def meter_case(group: Any) -> dict[str, dict[str, Any]]:
    """Per method: the reducer's own meter against a C10dCounter over the same two steps; PowerSGD's
    compressed steps (collectives posted in gloo callbacks) against a counting wrapper of dist.all_reduce."""
    rank = dist.get_rank(group)
    out: dict[str, dict[str, Any]] = {}
    for kind in ("none", "bf16", "fp16", "int8", "topk", "randomk", "threshold", "dgc", "powersgd"):
        reducer = build_reducer(kind if kind != "powersgd" else PowerSGDOptions(start_step=2, rank=2),
                                own_group(group) if kind == "powersgd" else group)
        seen = WireMeter()
        for s in range(2):
            with C10dCounter(seen):
                step(reducer, {i: grad(60, rank, s, NUMEL[i], torch.float32) for i in SHAPES})
        out[kind] = {"reducer": reducer.meter.snapshot(), "dispatch": seen.snapshot()}
        if kind == "powersgd":
            out["powersgd_compressed"] = _powersgd_wrapped(reducer, rank)
    return out


def _powersgd_wrapped(reducer: Reducer, rank: int) -> dict[str, Any]:
    seen = WireMeter()
    original = dist.all_reduce

    def counting(tensor: Tensor, *args: Any, **kwargs: Any) -> Any:
        group = kwargs.get("group")
        seen.record("all_reduce", tensor.numel() * tensor.element_size(), dist.get_world_size(group))
        return original(tensor, *args, **kwargs)

    reducer.meter.reset()
    dist.all_reduce = counting  # type: ignore[assignment]  # this worker process only
    try:
        for s in range(2, 4):
            step(reducer, {i: grad(60, rank, s, NUMEL[i], torch.float32) for i in SHAPES})
    finally:
        dist.all_reduce = original  # type: ignore[assignment]
    return {"reducer": reducer.meter.snapshot(), "wrapped": seen.snapshot()}


def _reverse_finish_equal(group: Any) -> bool:
    """Finishing a step's reductions last-started first gives the same means (int8: two phases each, with
    nearest rounding, since stochastic rounding's draws follow the order phases run in; PowerSGD: the
    second bucket's hook waits for the first's chain)."""
    rank = dist.get_rank(group)
    same = True
    for spec in (Int8Options(block=16, stochastic=False), PowerSGDOptions(rank=1, start_step=2)):
        means = []
        for reverse in (False, True):
            reducer = build_reducer(spec, own_group(group))
            for s in range(4):
                started = []
                for i in SHAPES:
                    bucket = Bucket(i, SHAPES[i])
                    bucket.buffer().copy_(grad(80 + i, rank, s, NUMEL[i], torch.float32))
                    started.append(reducer.start(bucket))
                got = [r.finish().clone() for r in (reversed(started) if reverse else started)]
                reducer.end_step(True)
            means.append(got[::-1] if reverse else got)
        same &= all(torch.equal(a, b) for a, b in zip(*means, strict=True))
    return same


def api_errors_case(group: Any) -> dict[str, str]:
    """The reducer's misuse errors, the wait callable's descriptions, finish order, as text."""
    out: dict[str, str] = {}
    reducer = build_reducer("int8", group)
    bucket = Bucket(2, [(4,)])
    pending = reducer.start(bucket)
    for name, call in (("twice", lambda: reducer.start(Bucket(2, [(4,)]))),
                       ("unfinished", lambda: reducer.end_step(True)),
                       ("method", lambda: reducer.load_state_dict({"method": "topk"}))):
        try:
            call()
            out[name] = "no error"
        except (RuntimeError, ValueError) as exc:
            out[name] = f"{type(exc).__name__}: {exc}"
    waited: list[str] = []

    def recording_wait(work: Any, what: str) -> None:
        waited.append(what)
        work.wait()

    pending.finish(recording_wait)
    reducer.end_step(True)
    out["waited"] = " / ".join(waited)
    out["compute_s_positive"] = str(pending.compute_s > 0)
    out["reverse_finish_equal"] = str(_reverse_finish_equal(group))
    bad = Bucket(3, [(4,)])
    bad.set_buffer(torch.zeros(8)[::2])  # strided: not a flat contiguous buffer
    try:
        build_reducer("topk", group).start(bad)
        out["buffer"] = "no error"
    except ValueError as exc:
        out["buffer"] = str(exc)
    return out


def ratio_case(group: Any, numel: int = 1 << 16) -> dict[str, float]:
    """fp32 all-reduce bytes over each method's bytes, from the reducers' meters, on one realistic bucket."""
    rank, n = dist.get_rank(group), dist.get_world_size(group)
    baseline = ring_bytes("all_reduce", numel * 4, n)
    out = {}
    for kind in ("bf16", "int8", "topk"):
        reducer = build_reducer(kind, group)
        bucket = Bucket(0, [(numel,)])
        bucket.buffer().copy_(grad(8, rank, 0, numel, torch.float32))
        reducer.start(bucket).finish()
        reducer.end_step(True)
        out[kind] = baseline / reducer.meter.total_bytes
    return out


def fp8_wire_case(group: Any) -> dict[str, bool]:
    """fp8 payloads moved by all_gather as their uint8 view (gloo rejects float8): every rank rebuilds
    every rank's dequantized tensor bit for bit."""
    rank, n = dist.get_rank(group), dist.get_world_size(group)
    out = {}
    for fmt in ("e4m3", "e5m2"):
        inputs = [grad(90, r, 0, 60, torch.float32).view(6, 10) for r in range(n)]
        payload, scales = quantize_fp8(inputs[rank], fmt)
        wire = fp8_to_wire(payload)
        wires, all_scales = torch.empty((n * 6, 10), dtype=torch.uint8), torch.empty(n * 6)
        dist.all_gather_into_tensor(wires, wire, group=group)
        dist.all_gather_into_tensor(all_scales, scales, group=group)
        got = [dequantize_fp8(fp8_from_wire(w, fmt), sc) for w, sc in zip(wires.split(6), all_scales.split(6),
                                                                          strict=True)]
        want = [dequantize_fp8(*quantize_fp8(x, fmt)) for x in inputs]
        out[fmt] = all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
    return out


class WireRoundTrip(torch.autograd.Function):
    """A compressed stage send's round trips in a single process: the activation codec forward, the gradient codec
    backward (what a rank boundary does to a microbatch; the reference the pipelines with compressed sends meet)."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, act: Any, grad: Any) -> Tensor:  # noqa: D102
        ctx.grad_codec = grad
        return x if act is None else act.decode(act.encode(x), TensorSpec.of(x))

    @staticmethod
    def backward(ctx: Any, g: Tensor) -> tuple[Tensor, None, None]:  # noqa: D102
        codec = ctx.grad_codec
        return (g if codec is None else codec.decode(codec.encode(g), TensorSpec.of(g))), None, None
