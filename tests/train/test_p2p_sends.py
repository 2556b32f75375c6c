"""Low-precision stage-to-stage sends end to end: PipelineConfig(p2p_compression=...) on gloo, in one spawn of 4.

Every codec runs 1F1B and DualPipe on 4 ranks through `Pipeline` and is compared with (a) the same run
with fp32 sends, within a stated bound, and (b) a single-process reference that applies the codec's
round trip at every rank boundary (forward to the activation, backward to the gradient), which the
pipeline must match to fp32 rounding. Bytes per SEND are checked against the wire format by hand and
against a c10d dispatch counter. On 2 ranks: NaN/inf through the codecs (they arrive non-finite, are
counted and warned about; the strict policy stops every rank) and an fp16 overflow step that the loss
scaler skips everywhere.
"""

from __future__ import annotations

import math
import warnings
from typing import Any

import pytest
import torch
import torch.distributed as dist
from _comm_cases import WireRoundTrip
from _executor_cases import _attempt, _inputs, stage_setup
from models import DIM, SEQ, VOCAB, loss_fn, make_batch, make_parts, rel_err
from torch import Tensor, nn

from duplexpipe import LossScaleConfig, Pipeline, PipelineConfig
from duplexpipe.comm.meter import C10dCounter, WireMeter
from duplexpipe.comm.p2p_codecs import p2p_codec_pair
from duplexpipe.runtime import PipelineRuntime, RuntimeConfig
from duplexpipe.schedules.ir import Op, Schedule
from duplexpipe.train.pipeline_config import PrecisionConfig, SafetyConfig

LABELS = (None, "bf16", "fp8", "int8")
SCHEDULES = ("1f1b", "dualpipe")
M = 8
ROWS = 2 * M
"""Batch rows: 2 per microbatch, so every message is (2, SEQ, DIM) float32."""
UNIT = {None: 0.0, "bf16": 2.0**-8, "fp8": 2.0**-3, "int8": 2.0**-7}
"""Per-element rounding unit of the coarser of the two codecs, relative to the row's or block's largest
magnitude: bf16 2**-8 of the value itself, fp8 e5m2 2**-3 (e4m3 2**-4), int8 scale/2 = max/254 < 2**-7."""
CROSSINGS = 3
"""Rank boundaries a microbatch crosses each way on 4 ranks."""
EMULATED = 1e-6
"""Pipeline vs the single-process run with the same round trips: only fp32 summation order differs (a few ulps)."""
WORLD = 4
SPAWN_TIMEOUT_S = 240
"""conftest.py's `results` fixture runs `_worker` once on WORLD gloo ranks within this bound."""


def emulated_grads(schedule: Schedule, parts: list[nn.Module], batch: tuple[Tensor, Tensor],
                   label: str | None) -> list[list[Tensor]]:
    """Single process, microbatch by microbatch, with the codec round trips wherever a microbatch's
    consecutive stages sit on different ranks; gradients of the batch's mean loss, per model part."""
    act, grad = p2p_codec_pair(label)
    for p in parts:
        p.zero_grad(set_to_none=True)
    groups = schedule.num_groups
    for mb, (x, y) in enumerate(zip(batch[0].chunk(M), batch[1].chunk(M), strict=True)):
        copy = schedule.copy_of_microbatch(mb)
        h = x
        for k in range(groups):
            h = parts[k](h)
            here, there = copy * groups + k, copy * groups + k + 1
            if k + 1 < groups and schedule.stages[here].rank != schedule.stages[there].rank:
                h = WireRoundTrip.apply(h, act, grad)
        (loss_fn(h, y) * (x.shape[0] / ROWS)).backward()
    return [[p.grad.clone() for p in part.parameters()] for part in parts]


def _send_bytes(label: str | None) -> int:
    """Bytes of one (2, SEQ, DIM) float32 message on the wire, by hand (not from the codec)."""
    numel, rows = 2 * SEQ * DIM, 2 * SEQ
    return {None: 4 * numel, "bf16": 2 * numel, "fp8": numel + 4 * rows,
            "int8": numel + 4 * math.ceil(numel / 256)}[label]


def _grads(pipe: Pipeline) -> dict[int, list[Tensor]]:
    return {s: [p.grad.clone() for p in m.parameters()] for s, m in pipe.stage_state_modules.items()}


def _train_case(name: str, rank: int) -> dict[str, Any]:
    """Each compression on one schedule: errors vs fp32 sends and vs the emulation, bytes per send."""
    batch = make_batch(ROWS, 5)
    out: dict[str, Any] = {}
    base: dict[int, list[Tensor]] = {}
    base_loss = 0.0
    for label in LABELS:
        parts = make_parts(4, seed=3)
        config = PipelineConfig(schedule=name, num_microbatches=M, precision=PrecisionConfig(p2p_compression=label))
        pipe = Pipeline(parts, loss_fn, lambda ps: torch.optim.SGD(ps, lr=0.0), config)
        loss = pipe.step(*batch)
        grads = _grads(pipe)
        if label is None:
            base, base_loss = grads, loss
        want = emulated_grads(pipe.schedule, parts, batch, label)
        sends = sum(1 for a in pipe.runtime.schedule.actions[rank] if a.op in (Op.SEND_F, Op.SEND_B))
        out[str(label)] = {
            "loss_vs_fp32": abs(loss - base_loss) / base_loss,
            "grad_vs_fp32": max(rel_err(g, w) for s in grads for g, w in zip(grads[s], base[s], strict=True)),
            "grad_vs_emulated": max(rel_err(g, w) for s, gs in grads.items()
                                    for g, w in zip(gs, want[pipe.schedule.stages[s].group], strict=True)),
            "sends": (pipe.p2p_meter.calls["send"], sends),
            "bytes": (pipe.p2p_meter.bytes["send"], sends * _send_bytes(label)),
        }
    return out


class _PipelineSends(C10dCounter):
    """Counts the c10d sends on the pipeline's tag (0) only: the runtime's step-start agreement and loss
    sum are small messages on their own tags."""

    def _count(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        named = {a.name: v for a, v in zip(func._schema.arguments, args, strict=False)} | kwargs
        if named.get("tag", 0) == 0:
            super()._count(func, args, kwargs)


def _counter_case(rank: int) -> dict[str, Any]:
    """The transport's meter against a dispatch-level count of the c10d send ops on the pipeline's tag
    (int8, 1F1B: no mirror sum, so every such send is a stage-to-stage payload; two payloads, codes and
    scales, per SEND)."""
    parts = make_parts(4, seed=4)
    pipe = Pipeline(parts, loss_fn, lambda ps: torch.optim.SGD(ps, lr=0.0),
                    PipelineConfig(schedule="1f1b", num_microbatches=M,
                                   precision=PrecisionConfig(p2p_compression="int8")))
    seen = WireMeter()
    with _PipelineSends(seen):
        pipe.step(*make_batch(ROWS, 6))
    return {"meter": pipe.p2p_meter.snapshot(), "c10d_send": (seen.calls["send"], seen.bytes["send"])}


def _overflow_case(group: Any, label: str) -> dict[str, Any]:
    """fp16 autocast and a loss scale of 2**40: the last stage's input gradient overflows; it must reach
    the first stage non-finite through the codec, and the sender must count and report it."""
    rank = dist.get_rank(group)
    schedule, _, modules = stage_setup("1f1b", 2, 4, rank, seed=11)
    act, grad = p2p_codec_pair(label)
    runtime = PipelineRuntime(schedule, modules, loss_fn, group=group,
                              config=RuntimeConfig(autocast_dtype=torch.float16, activation_codec=act,
                                                   gradient_codec=grad))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        runtime.step(*_inputs(schedule, rank, make_batch(8, 12)), loss_scale=2.0**40)
    grads = [p.grad for m in modules.values() for p in m.parameters() if p.grad is not None]
    return {"all_grads_finite": all(bool(g.isfinite().all()) for g in grads),
            "events": runtime.nonfinite.events,
            "warnings": [str(w.message) for w in caught if "held NaN or inf" in str(w.message)]}


def _strict_case(group: Any) -> dict[str, Any]:
    """An inf activation under the "raise" policy stops both ranks; the sender's error names the send."""
    rank = dist.get_rank(group)
    schedule, _, modules = stage_setup("1f1b", 2, 4, rank, seed=13)
    if 0 in modules:
        modules[0][0].weight.data[3] = float("inf")  # token 3's embedding
    act, grad = p2p_codec_pair("int8")
    runtime = PipelineRuntime(schedule, modules, loss_fn, group=group,
                              config=RuntimeConfig(activation_codec=act, gradient_codec=grad,
                                                   nonfinite_sends="raise", timeout_s=30))
    tokens, targets = make_batch(8, 14)
    tokens[:, 0] = 3
    return _attempt(lambda: runtime.step(*_inputs(schedule, rank, (tokens, targets))))


def _skip_case() -> dict[str, Any]:
    """Pipeline, DualPipe on 4 ranks, fp16 and fp8 sends: an overflowing first step is skipped on every
    rank, the next (scale backed off) is applied with a finite loss."""
    parts = make_parts(4, seed=15)
    scale = LossScaleConfig(init_scale=2.0**40, backoff_factor=2.0**-30)
    config = PipelineConfig(schedule="dualpipe", num_microbatches=M,
                            precision=PrecisionConfig(dtype="fp16", p2p_compression="fp8", loss_scale=scale))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        pipe = Pipeline(parts, loss_fn, lambda ps: torch.optim.SGD(ps, lr=0.1), config)
        steps = []
        for seed in (16, 17):
            loss = pipe.step(*make_batch(ROWS, seed))
            assert pipe.last is not None
            steps.append((pipe.last.skipped, pipe.last.applied, math.isfinite(loss)))
    return {"skip_steps": steps, "skip_events": pipe.runtime.nonfinite.events}


class _AttentionPart(nn.Module):
    """forward(x, mask): one attention block under an additive float mask (B, SEQ, SEQ) holding
    finfo(float32).min at masked keys, returning (hidden, mask); the last part returns logits. The mask
    flows forward only, beside hidden states that carry gradients."""

    def __init__(self, first: bool, last: bool) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM) if first else None
        self.qkv = nn.Linear(DIM, 3 * DIM)
        self.head = nn.Linear(DIM, VOCAB) if last else None

    def forward(self, x: Tensor, mask: Tensor) -> Any:
        h = self.embed(x) if self.embed is not None else x
        q, k, v = self.qkv(h).chunk(3, dim=-1)
        h = h + torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(DIM) + mask, dim=-1) @ v
        return self.head(h) if self.head is not None else (h, mask)


def _padded_causal_mask(rows: int) -> Tensor:
    """Causal, with the first token of every other row padding: that row's first query sees no key at all
    (softmax over finfo.min only: uniform and finite; over -inf it would be NaN)."""
    allowed = torch.ones(SEQ, SEQ).tril().bool().expand(rows, SEQ, SEQ).clone()
    allowed[::2, :, 0] = False
    return torch.zeros(rows, SEQ, SEQ).masked_fill(~allowed, torch.finfo(torch.float32).min)


MASK_STEPS = 5


def _mask_case() -> dict[str, Any]:
    """1F1B on 4 ranks, the attention parts above, 5 AdamW steps with each compression: the loss after them."""
    out: dict[str, Any] = {}
    for label in (None, "int8", "fp8"):
        torch.manual_seed(21)
        parts = [_AttentionPart(k == 0, k == 3) for k in range(4)]
        config = PipelineConfig(schedule="1f1b", num_microbatches=4, precision=PrecisionConfig(p2p_compression=label))
        pipe = Pipeline(parts, loss_fn, lambda ps: torch.optim.AdamW(ps, lr=1e-2), config)
        for step in range(MASK_STEPS):
            tokens, targets = make_batch(8, 30 + step)
            loss = pipe.step((tokens, _padded_causal_mask(8)), targets)
        out[str(label)] = {"loss": loss, "exact_sends": pipe.runtime.nonfinite.exact_sends,
                           "bytes": pipe.p2p_meter.bytes["send"]}
    return out


def _worker(rank: int, world: int) -> dict[str, Any]:
    pair = [dist.new_group([0, 1]), dist.new_group([2, 3])][rank // 2]
    out: dict[str, Any] = {name: _train_case(name, rank) for name in SCHEDULES}
    out["mask"] = _mask_case()
    out["counter"] = _counter_case(rank)
    out["skip"] = _skip_case()
    if rank < 2:  # the pair {0, 1}; the strict case leaves a receive pending on it, so it comes last
        out["overflow"] = {label: _overflow_case(pair, label) for label in ("bf16", "fp8", "int8")}
        out["strict"] = _strict_case(pair)
    return out


@pytest.mark.parametrize("name", SCHEDULES)
@pytest.mark.parametrize("label", LABELS[1:])
def test_each_codec_stays_within_its_bound_of_fp32_sends(results: Any, name: str, label: str) -> None:
    for rank, rec in enumerate(results):
        got = rec[name][label]
        assert got["loss_vs_fp32"] <= CROSSINGS * UNIT[label], (rank, got)
        assert got["grad_vs_fp32"] <= 2 * CROSSINGS * UNIT[label], (rank, got)
        assert got["grad_vs_fp32"] > 1e-6, (rank, got)  # the codec really rounded


@pytest.mark.parametrize("name", SCHEDULES)
@pytest.mark.parametrize("label", LABELS)
def test_the_pipeline_equals_a_single_process_run_with_the_same_round_trips(results: Any, name: str,
                                                                            label: str | None) -> None:
    for rank, rec in enumerate(results):
        got = rec[name][str(label)]
        assert got["grad_vs_emulated"] <= EMULATED, (rank, got)
        if label is not None:  # the emulation is far closer than fp32 sends: the codec is what differs
            assert got["grad_vs_emulated"] < got["grad_vs_fp32"] / 10, (rank, got)


@pytest.mark.parametrize("name", SCHEDULES)
@pytest.mark.parametrize("label", LABELS)
def test_bytes_per_send_match_the_wire_format(results: Any, name: str, label: str | None) -> None:
    for rank, rec in enumerate(results):
        got = rec[name][str(label)]
        calls, sends = got["sends"]
        assert calls == sends > 0, (rank, got)
        measured, expected = got["bytes"]
        assert measured == expected, (rank, got)


def test_the_meter_agrees_with_the_c10d_send_ops(results: Any) -> None:
    for rank, rec in enumerate(results):
        meter = rec["counter"]["meter"]
        ops, nbytes = rec["counter"]["c10d_send"]
        assert (2 * meter["calls"]["send"], meter["bytes"]["send"]) == (ops, nbytes), (rank, rec["counter"])
        assert meter["calls"]["send"] > 0


@pytest.mark.parametrize("label", ["bf16", "fp8", "int8"])
def test_an_overflowed_gradient_reaches_the_first_stage_non_finite_and_is_reported(results: Any,
                                                                                    label: str) -> None:
    first, last = results[0]["overflow"][label], results[1]["overflow"][label]
    assert not first["all_grads_finite"]  # received through the codec: still non-finite
    assert not last["all_grads_finite"]
    assert last["events"] >= 1 and first["events"] == 0  # only rank 1 sends gradients
    assert len(last["warnings"]) == 1, last["warnings"]  # warned once, counted every time
    assert "rank 1: stage 1 microbatch" in last["warnings"][0] and "(gradients)" in last["warnings"][0]


def test_the_strict_policy_stops_every_rank_naming_the_send(results: Any) -> None:
    sender, receiver = results[0]["strict"], results[1]["strict"]
    assert sender["type"] == "NonFiniteSendError", sender
    assert "rank 0: stage 0 microbatch 0: a tensor sent with codec 'int8-block256' held NaN or inf" in sender["text"]
    assert receiver["type"] == "PeerFailedError" and receiver["failed_rank"] == 0, receiver
    assert receiver["seconds"] < 20, receiver


def test_an_fp16_overflow_with_fp8_sends_is_skipped_everywhere_then_training_goes_on(results: Any) -> None:
    for rank, rec in enumerate(results):
        assert rec["skip"]["skip_steps"] == [(True, False, True), (False, True, True)], (rank, rec["skip"])
        assert rec["skip"]["skip_events"] >= 1, (rank, rec["skip"])  # every rank sent an overflowed gradient


@pytest.mark.parametrize("label", ["int8", "fp8"])
def test_a_finfo_min_mask_beside_compressed_activations_keeps_the_loss_finite_and_close(results: Any,
                                                                                     label: str) -> None:
    for rank, rec in enumerate(results):
        got, base = rec["mask"][label], rec["mask"]["None"]
        assert math.isfinite(got["loss"]) and math.isfinite(base["loss"]), (rank, rec["mask"])
        assert abs(got["loss"] - base["loss"]) <= 0.05 * base["loss"], (rank, rec["mask"])
        assert got["exact_sends"] == 0  # the mask travels exactly by rule (forward only), not as an exception
        for name, sent in ((label, got), (None, base)):  # the hidden states encoded, the mask exact, by hand
            hidden, mask = 2 * SEQ * DIM, 4 * 2 * SEQ * SEQ  # per microbatch of 2 rows; the mask in float32
            coded = {None: 4 * hidden, "int8": hidden + 4 * math.ceil(hidden / 256), "fp8": hidden + 4 * 2 * SEQ}
            per_step = 4 * (coded[name] + mask) * (rank < 3) + 4 * coded[name] * (rank > 0)
            assert sent["bytes"] == MASK_STEPS * per_step, (rank, name, rec["mask"])


@pytest.mark.parametrize(("options", "message"), [
    (lambda: PrecisionConfig(p2p_compression="fp16"),
     r"unknown p2p_compression 'fp16'; expected None, one of \['bf16', 'fp8', 'int8'\]"),
    (lambda: PrecisionConfig(p2p_compression=("fp8", "x")), r"unknown p2p_compression 'x'"),
    (lambda: PrecisionConfig(p2p_compression=object()), r"PrecisionConfig.p2p_compression must be None, one of"),
    (lambda: SafetyConfig(nonfinite_sends="ignore"),
     r"SafetyConfig.nonfinite_sends must be one of \['warn', 'raise'\], got 'ignore'"),
    (lambda: PipelineConfig(safety=SafetyConfig(nonfinite_sends="raise"), precision=PrecisionConfig("fp16")),
     r"nonfinite_sends='raise' with precision='fp16': dynamic loss scaling overflows routinely"),
])
def test_bad_or_incompatible_options_raise_naming_the_values(options: Any, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        options()


def test_good_options_are_accepted() -> None:
    for value in (None, "bf16", "fp8", "int8", ("fp8", None), p2p_codec_pair("int8")):
        assert PipelineConfig(precision=PrecisionConfig(p2p_compression=value),
                              safety=SafetyConfig(nonfinite_sends="raise")).precision.p2p_compression is value
    with pytest.raises(ValueError, match=r"RuntimeConfig.p2p_meter must be a duplexpipe.comm.WireMeter"):
        RuntimeConfig(p2p_meter={})  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"RuntimeConfig.nonfinite_sends must be one of"):
        RuntimeConfig(nonfinite_sends="off")
