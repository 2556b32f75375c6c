"""Worker-side cases pinning the GradBucket contract torch's DDP hooks rely on: our reducers on Bucket
stand-ins against torch's bf16 and PowerSGD hooks run through real DDP buckets, and PowerSGD state keyed by index()."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from _comm_cases import NUMEL, SHAPES, grad, own_group
from torch import Tensor, nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import PowerSGDState, powerSGD_hook

from duplexpipe.comm import Bucket, Reducer, build_reducer
from duplexpipe.dp_options.compression import PowerSGDOptions


def _recording(hook: Any, records: list[dict[str, Any]]) -> Any:
    """A DDP hook that runs `hook` and records each bucket's index, shapes, input and output."""
    def run(state, bucket):  # type: ignore[no-untyped-def]  # DDP rejects annotations other than its own
        record = {"index": bucket.index(), "shapes": [tuple(g.shape) for g in bucket.gradients()],
                  "input": bucket.buffer().clone()}
        records.append(record)

        def keep(fut: Any) -> Any:
            record["output"] = fut.value().clone()
            return fut.value()
        return hook(state, bucket).then(keep)
    return run


def _ddp_records(group: Any, hook: Any, state: Any, steps: int) -> list[dict[str, Any]]:
    """Run a small model under DDP with `hook` for `steps` backward passes (weights fixed, data per rank)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 5)).double()
    ddp = nn.parallel.DistributedDataParallel(model, process_group=group)
    records: list[dict[str, Any]] = []
    ddp.register_comm_hook(state, _recording(hook, records))
    for s in range(steps):
        gen = torch.Generator().manual_seed(100 * dist.get_rank(group) + s)
        ddp(torch.randn(7, 6, generator=gen, dtype=torch.float64)).square().sum().backward()
        model.zero_grad(set_to_none=True)
    return records


def ddp_contract_case(group: Any) -> dict[str, Any]:
    """The GradBucket contract pin: torch's bf16 and PowerSGD hooks through real DDP buckets against our
    reducers on Bucket stand-ins fed the same inputs (bit for bit), and bf16 against a hand computation."""
    n = dist.get_world_size(group)
    out: dict[str, Any] = {}
    records = _ddp_records(group, default_hooks.bf16_compress_hook, group, 3)
    reducer = build_reducer("bf16", group)
    same, hand = True, True
    for r in records:
        got = step_one(reducer, r)
        same &= torch.equal(got, r["output"])
        inputs = [torch.empty_like(r["input"]) for _ in range(n)]
        dist.all_gather(inputs, r["input"], group=group)
        want = inputs[0].to(torch.bfloat16).div(n)
        for other in inputs[1:]:
            want = want + other.to(torch.bfloat16).div(n)
        hand &= torch.equal(got, want.to(got.dtype))
    out["bf16"] = {"calls": len(records), "equal_ddp": same, "equal_hand": hand}

    state = PowerSGDState(process_group=group, matrix_approximation_rank=1, start_powerSGD_iter=2,
                          min_compression_rate=0.5, random_seed=0)
    records = _ddp_records(group, powerSGD_hook, state, 5)
    reducer = build_reducer(PowerSGDOptions(rank=1, start_step=2, min_compression_rate=0.5), own_group(group))
    same = all(torch.equal(step_one(reducer, r), r["output"]) for r in records)
    out["powersgd"] = {"calls": len(records), "equal_ddp": same, "compressed": state.iter - 2,
                       "indices": sorted({r["index"] for r in records})}
    return out


def step_one(reducer: Reducer, record: dict[str, Any]) -> Tensor:
    """One step of one recorded DDP bucket through `reducer` on a Bucket stand-in."""
    bucket = Bucket(record["index"], record["shapes"], dtype=record["input"].dtype)
    bucket.buffer().copy_(record["input"])
    result = reducer.start(bucket).finish().clone()
    reducer.end_step(True)
    return result


def powersgd_index_case(group: Any) -> dict[str, Any]:
    """PowerSGD's error and warm-start state follow index(): persistent Bucket objects in a fixed order
    give the same means as fresh objects whose start order flips once Q is warm."""
    rank = dist.get_rank(group)

    def run(fresh: bool) -> tuple[list[dict[int, Tensor]], list[int]]:
        reducer = build_reducer(PowerSGDOptions(rank=2, start_step=2), own_group(group))
        kept = {i: Bucket(i, SHAPES[i]) for i in SHAPES}
        means = []
        for s in range(7):
            order = sorted(SHAPES, reverse=fresh and s >= 4)
            reductions = {}
            for i in order:
                bucket = Bucket(i, SHAPES[i]) if fresh else kept[i]
                bucket.buffer().copy_(grad(70 + i, rank, s, NUMEL[i], torch.float32))
                reductions[i] = reducer.start(bucket)
            means.append({i: reductions[i].finish().clone() for i in order})
            reducer.end_step(True)
        return means, sorted(reducer.state.error_dict)  # type: ignore[attr-defined]

    kept_means, kept_keys = run(False)
    fresh_means, fresh_keys = run(True)
    return {"equal": all(torch.equal(a[i], b[i]) for a, b in zip(kept_means, fresh_means, strict=True)
                         for i in SHAPES),
            "keys": fresh_keys, "kept_keys": kept_keys}
