"""Tests for duplexpipe.model.hf: parts of transformers causal LMs compute the whole model's logits
and loss, and train with every schedule exactly as the model does in one process."""

from __future__ import annotations

import pytest

pytest.importorskip("transformers")

import hashlib  # noqa: E402
from typing import Any  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from _hf_helpers import (  # noqa: E402
    BUILDERS,
    padded_labels,
    padding_mask,
    rel,
    run_parts,
    tiny_gpt2,
    tiny_llama,
    tiny_mistral,
    token_batch,
    transformers,
)
from models import run_workers  # noqa: E402
from torch import nn  # noqa: E402

from duplexpipe.model.hf import (  # noqa: E402
    CausalLMPart,
    causal_lm_loss,
    causal_lm_parts,
    causal_lm_targets,
)
from duplexpipe.model.stages import CheckpointedStage  # noqa: E402
from duplexpipe.parallel.mesh import make_mesh  # noqa: E402
from duplexpipe.parallel.tied import TiedGrads  # noqa: E402
from duplexpipe.schedules.registry import build as build_schedule  # noqa: E402
from duplexpipe.train.trainer import Pipeline, PipelineConfig  # noqa: E402


def _inputs(ids: torch.Tensor, mask: torch.Tensor | None) -> object:
    return ids if mask is None else {"input_ids": ids, "attention_mask": mask}


@pytest.mark.parametrize("arch", sorted(BUILDERS))
@pytest.mark.parametrize("padding", ["none", "right+hole", "left+right+hole"])
def test_parts_compose_to_the_model_logits_fp32(arch: str, padding: str) -> None:
    model = BUILDERS[arch](layers=4).eval()
    ids, _ = token_batch(0, rows=6)
    mask = None if padding == "none" else padding_mask(6, left=padding.startswith("left"))
    with torch.no_grad():
        want = model(ids, attention_mask=mask).logits
        for n in (1, 2, 3, 4):
            got = run_parts(causal_lm_parts(model, n), _inputs(ids, mask))
            assert got.shape == want.shape == (6, 8, 96)
            assert rel(got, want) <= 1e-6, (arch, padding, n)


@pytest.mark.parametrize("arch", sorted(BUILDERS))
def test_parts_compose_to_the_model_logits_fp64(arch: str) -> None:
    model = BUILDERS[arch](layers=4).double().eval()
    ids, _ = token_batch(1, rows=6)
    mask = padding_mask(6, left=False)  # no fully masked query row: eager fp64 gives NaN there, as the model
    with torch.no_grad():
        for m in (None, mask):
            want = model(ids, attention_mask=m).logits
            got = run_parts(causal_lm_parts(model, 3), _inputs(ids, m))
            assert got.dtype == torch.float64 and rel(got, want) <= 1e-12, (arch, m is not None)


def test_the_mask_and_the_sliding_window_matter() -> None:
    """The equality tests above would be vacuous if masks or windows changed nothing."""
    ids, _ = token_batch(2, rows=6)
    mask = padding_mask(6)
    for model in (tiny_llama(layers=2), tiny_gpt2(layers=2)):
        with torch.no_grad():
            plain = run_parts(causal_lm_parts(model, 2), ids)
            masked = run_parts(causal_lm_parts(model, 2), {"input_ids": ids, "attention_mask": mask})
        assert rel(masked, plain) > 1e-3
        assert torch.equal(masked[0, :, :], plain[0, :, :])  # row 0 has no padding
    windowed, full = tiny_mistral(layers=2, window=4), tiny_mistral(layers=2, window=None)
    with torch.no_grad():
        a, b = run_parts(causal_lm_parts(windowed, 2), ids), run_parts(causal_lm_parts(full, 2), ids)
    assert torch.equal(a[:, :4], b[:, :4]) and rel(a[:, 4:], b[:, 4:]) > 1e-3  # the window starts to cut at 4


def test_position_ids_are_carried_to_every_part() -> None:
    """Packed sequences: the library masks attention between them (no KV cache, as in training)."""
    model = tiny_llama(layers=3).eval()
    ids, _ = token_batch(3, rows=4)
    positions = torch.arange(4).repeat(4, 2)  # two packed sequences per row: 0..3, 0..3
    parts = causal_lm_parts(model, 3)
    with torch.no_grad():
        want = model(ids, position_ids=positions, use_cache=False).logits
        message = parts[0](ids, position_ids=positions)
        assert set(message) == {"hidden_states", "position_ids"}
        got = run_parts(parts[1:], message)
        assert rel(got, want) <= 1e-6
        assert rel(got, model(ids).logits) > 1e-3


def test_layers_are_balanced_embedding_first_head_last() -> None:
    model = tiny_llama(layers=7)
    parts = causal_lm_parts(model, 3)
    assert [p.layer_ids for p in parts] == [range(0, 3), range(3, 5), range(5, 7)]
    assert [p.is_first for p in parts] == [True, False, False] and [p.is_last for p in parts] == [False, False, True]
    assert parts[0].embed_tokens is model.model.embed_tokens and parts[1].embed_tokens is None
    assert parts[2].norm is model.model.norm and parts[2].lm_head is model.lm_head and parts[0].norm is None
    names = [set(dict(p.named_parameters())) for p in parts]
    assert "layers.3.self_attn.q_proj.weight" in names[1]  # global layer numbers in the state_dict keys
    ids = {id(q) for p in parts for q in p.parameters()}
    assert ids == {id(q) for q in model.parameters()}  # every weight in exactly one part
    assert sum(len(n) for n in names) == len(list(model.parameters()))
    explicit = causal_lm_parts(model, 3, balance=[1, 1, 5])
    assert [p.layer_ids for p in explicit] == [range(0, 1), range(1, 2), range(2, 7)]
    assert "part 1 of 3, layers 1..1" in repr(explicit[1])


def test_gpt2_parts_share_the_tied_embedding() -> None:
    model = tiny_gpt2(layers=4)
    parts = causal_lm_parts(model, 2)
    assert parts[0].wte is not None and parts[1].lm_head is not None
    assert parts[0].wte.weight is parts[1].lm_head.weight  # one Parameter: Pipeline sums its gradients
    untied = causal_lm_parts(tiny_gpt2(layers=4, tie_word_embeddings=False), 2)
    assert untied[0].wte.weight is not untied[1].lm_head.weight


def test_bad_models_and_splits_are_rejected() -> None:
    with pytest.raises(ValueError, match="does not support Linear; supported: LlamaForCausalLM"):
        causal_lm_parts(nn.Linear(2, 2), 2)
    with pytest.raises(ValueError, match="cannot split 4 layers into 5 model parts"):
        causal_lm_parts(tiny_llama(layers=4), 5)
    with pytest.raises(ValueError, match=r"balance \[1, 1\] sums to 2, but the model has 4 layers"):
        causal_lm_parts(tiny_llama(layers=4), 2, balance=[1, 1])
    with pytest.raises(ValueError, match="num_parts must be an integer, got 2.0"):
        causal_lm_parts(tiny_llama(layers=4), 2.0)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="add_cross_attention=True is not supported"):
        causal_lm_parts(tiny_gpt2(layers=2, add_cross_attention=True), 2)


def test_bad_part_inputs_are_named() -> None:
    parts: list[CausalLMPart] = causal_lm_parts(tiny_llama(layers=2), 2)
    ids, _ = token_batch(0, rows=2)
    with pytest.raises(TypeError, match=r"part 0: unexpected input 'labels' \(expected one of \('input_ids'"):
        parts[0](ids, labels=ids)
    with pytest.raises(TypeError, match="part 1 needs 'hidden_states' as a tensor, got NoneType"):
        parts[1](attention_mask=ids)
    with pytest.raises(TypeError, match="'attention_mask' .given twice"):
        parts[0](ids, ids, attention_mask=ids)
    with pytest.raises(TypeError, match="takes at most 3 inputs"):
        parts[0](ids, None, None, ids)


def test_loss_is_the_model_loss() -> None:
    model = tiny_llama(layers=2)
    ids, labels = token_batch(4, rows=4)
    labels[1, 5:] = -100
    out = model(ids, labels=labels)
    assert causal_lm_loss(out.logits, labels).item() == pytest.approx(out.loss.item(), rel=1e-6)
    assert causal_lm_loss(out.logits, causal_lm_targets(labels)).item() == pytest.approx(out.loss.item(), rel=1e-6)


def _pipelined_loss(logits: torch.Tensor, targets: object, rows: list[int]) -> torch.Tensor:
    """What the runtime computes: microbatch losses weighted by their share of the batch rows."""
    total, start, batch = torch.zeros(()), 0, logits.shape[0]
    for n in rows:
        part = slice(start, start + n)
        mb = targets[part] if isinstance(targets, torch.Tensor) else {k: v[part] for k, v in targets.items()}
        total = total + causal_lm_loss(logits[part], mb) * (n / batch)
        start += n
    return total


def test_token_weighted_targets_make_padded_microbatches_exact() -> None:
    model = tiny_gpt2(layers=2)
    ids, _ = token_batch(5, rows=6)
    labels = padded_labels(ids, padding_mask(6, left=False))
    out = model(ids, labels=labels)
    for rows in ([2, 2, 2], [3, 3], [1, 2, 3]):
        exact = _pipelined_loss(out.logits, causal_lm_targets(labels), rows)
        assert exact.item() == pytest.approx(out.loss.item(), rel=1e-6), rows
        plain = _pipelined_loss(out.logits, labels, rows)  # per-microbatch means: the documented caveat
        assert abs(plain.item() - out.loss.item()) > 1e-4 * out.loss.item(), rows
    unpadded = token_batch(5, rows=6)[1]
    plain = _pipelined_loss(out.logits, unpadded, [2, 2, 2])
    assert plain.item() == pytest.approx(causal_lm_loss(out.logits, unpadded).item(), rel=1e-6)


def test_bad_targets_are_rejected() -> None:
    logits = torch.zeros(2, 8, 96)
    with pytest.raises(ValueError, match=r"targets must be labels or causal_lm_targets\(labels\), got \['labels'\]"):
        causal_lm_loss(logits, {"labels": torch.zeros(2, 8, dtype=torch.long)})
    with pytest.raises(ValueError, match="labels count no token"):
        causal_lm_targets(torch.full((2, 8), -100))
    with pytest.raises(ValueError, match=r"labels must be \(batch, seq\), got shape \(8,\)"):
        causal_lm_targets(torch.zeros(8, dtype=torch.long))


# ---- pipelined training equals the model trained in one process (one spawn of 4, one of 2) ----

STEPS = 3
CLIP = 0.5


def _adamw(params: list[nn.Parameter]) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.01)


def _fingerprint(t: torch.Tensor) -> str:
    return hashlib.sha256(t.detach().contiguous().view(-1).view(torch.uint8).numpy().tobytes()).hexdigest()[:16]


def _rows(value: Any, lo: int, hi: int) -> Any:
    return {k: v[lo:hi] for k, v in value.items()} if isinstance(value, dict) else value[lo:hi]


def _train(schedule: str, microbatches: int, arch: str, clip: float | None = None, dp: int = 1,
           control: bool = False, padded: bool = False) -> dict[str, Any]:
    """STEPS AdamW steps on one batch, pipelined and of the whole model in one process; losses and weights
    compared. `control`: skip the tied-gradient sum (a negative control: the losses must then differ).
    `padded`: an attention mask flows between the stages and padding labels are -100 (rows count
    different numbers of tokens; the targets weight every token alike)."""
    pp = dist.get_world_size() // dp
    model = BUILDERS[arch](layers=8)
    parts = causal_lm_parts(model, build_schedule(schedule, pp, microbatches).num_groups)
    model_names = {id(p): n for n, p in model.named_parameters()}
    names = [{n: model_names[id(p)] for n, p in part.named_parameters()} for part in parts]
    cfg = PipelineConfig(schedule=schedule, num_microbatches=microbatches, grad_clip_norm=clip)
    pipe = Pipeline(parts, causal_lm_loss, _adamw, cfg, mesh=make_mesh(pp, dp) if dp > 1 else None)
    if control:
        pipe.tied = TiedGrads([], pipe.schedule, pipe.groups.pp_rank, {})
    optimizer = _adamw(list(model.parameters()))
    ids, labels = token_batch(0, rows=8)
    mask = padding_mask(8) if padded else None
    inputs: Any = ids if mask is None else {"input_ids": ids, "attention_mask": mask}
    targets: Any = labels if mask is None else causal_lm_targets(padded_labels(ids, mask))
    losses, ref, norms = [], [], []
    rows = 8 // dp
    for _ in range(STEPS):
        loss = model(ids, attention_mask=mask, labels=labels if mask is None else targets["labels"]).loss
        loss.backward()
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        optimizer.step()
        optimizer.zero_grad()
        ref.append(loss.item())
        lo = pipe.groups.dp_rank * rows
        losses.append(pipe.step(_rows(inputs, lo, lo + rows), _rows(targets, lo, lo + rows)))
        norms.append(pipe.last.grad_norm if pipe.last is not None else None)
    want = dict(model.named_parameters())
    diff = norm = 0.0  # over all of this rank's weights: Adam turns the pure-noise gradients of
    tied = {}  # attention key biases into +-lr steps, so single tensors are no fair measure
    for stage, module in pipe.stage_state_modules.items():
        group = pipe.schedule.stages[stage].group
        for n, p in module.named_parameters():
            ref_p = want[names[group][n]].detach().double()
            diff += (p.detach().double() - ref_p).square().sum().item()
            norm += ref_p.square().sum().item()
            if names[group][n] == "transformer.wte.weight":
                tied[stage] = _fingerprint(p)
    loss_rel = max(abs(a - b) / b for a, b in zip(losses, ref, strict=True))
    return {"loss_rel": loss_rel, "weights_rel": (diff / norm) ** 0.5, "tied": tied, "norms": norms,
            "decreased": losses[-1] < losses[0]}


FOUR = {
    "llama-1f1b": ("1f1b", 4, "llama"),
    "llama-zbv": ("zbv", 4, "llama"),
    "llama-dualpipe": ("dualpipe", 8, "llama"),
    "llama-dualpipev": ("dualpipev", 8, "llama"),
    "gpt2-1f1b-clip": ("1f1b", 4, "gpt2", CLIP),
    "gpt2-zbv": ("zbv", 4, "gpt2"),
    "gpt2-dualpipe-clip": ("dualpipe", 8, "gpt2", CLIP),
    "gpt2-pp2xdp2": ("1f1b", 4, "gpt2", CLIP, 2),
    "llama-dualpipe-padded": ("dualpipe", 8, "llama", None, 1, False, True),
    "llama-zbv-padded": ("zbv", 4, "llama", None, 1, False, True),
}
TWO = {
    "gpt2-1f1b": ("1f1b", 4, "gpt2", CLIP),
    "gpt2-control": ("1f1b", 4, "gpt2", CLIP, 1, True),
    "gpt2-1f1b-padded": ("1f1b", 4, "gpt2", None, 1, False, True),
}


def _cases(rank: int, world: int, cases: dict[str, tuple[Any, ...]]) -> dict[str, Any]:
    transformers.logging.set_verbosity_error()
    return {name: _train(*args) for name, args in cases.items()}


@pytest.fixture(scope="module")
def four() -> list[dict[str, Any]]:
    return run_workers(_cases, 4, (FOUR,), timeout_s=400)


@pytest.fixture(scope="module")
def two() -> list[dict[str, Any]]:
    return run_workers(_cases, 2, (TWO,), timeout_s=200)


def _check(results: list[dict[str, Any]], case: str) -> None:
    if case == "gpt2-control":  # without the tied sum the head's gradient misses the embedding's
        assert all(res[case]["loss_rel"] > 1e-3 for res in results), [res[case] for res in results]
        return
    for rank, res in enumerate(results):
        got = res[case]
        assert got["loss_rel"] <= 1e-5, (case, rank, got)
        assert got["weights_rel"] <= 1e-5, (case, rank, got)
        assert got["decreased"], (case, rank, got)
    tied = {fp for res in results for fp in res[case]["tied"].values()}
    assert len(tied) == (1 if case.startswith("gpt2") else 0), (case, [r[case]["tied"] for r in results])
    norms = results[0][case]["norms"]
    if FOUR.get(case, TWO.get(case, ()))[3:4] == (CLIP,):  # clipped: active, and the same norm everywhere
        assert any(n > CLIP for n in norms) and all(r[case]["norms"] == norms for r in results), norms


@pytest.mark.timeout(420)
@pytest.mark.parametrize("case", list(FOUR))
def test_pipelined_training_equals_the_model_in_one_process(four: list[dict[str, Any]], case: str) -> None:
    _check(four, case)


@pytest.mark.timeout(220)
@pytest.mark.parametrize("case", list(TWO))
def test_two_ranks(two: list[dict[str, Any]], case: str) -> None:
    _check(two, case)


def test_checkpointed_parts_take_dict_messages() -> None:
    """Activation checkpointing wraps a part; a dict message reaches it as keywords."""
    model = tiny_llama(layers=2)
    ids, labels = token_batch(6, rows=4)
    mask = padding_mask(4)
    parts = causal_lm_parts(model, 2)
    message = parts[0](ids, attention_mask=mask)
    hidden = message["hidden_states"].detach().requires_grad_(True)
    plain = parts[1](hidden_states=hidden, attention_mask=mask)
    (grad,) = torch.autograd.grad(causal_lm_loss(plain, labels), hidden)
    hidden2 = hidden.detach().requires_grad_(True)
    wrapped = CheckpointedStage(parts[1])(hidden_states=hidden2, attention_mask=mask)
    (grad2,) = torch.autograd.grad(causal_lm_loss(wrapped, labels), hidden2)
    assert torch.equal(plain, wrapped) and torch.equal(grad, grad2)


@pytest.mark.parametrize("arch", sorted(BUILDERS))
def test_parts_name_their_state_as_the_model_does(arch: str) -> None:
    """Checkpoint keys: every part's state maps to the model's own names, each name exactly once over the parts."""
    from duplexpipe.model.state_names import part_state_keys

    model = BUILDERS[arch](layers=4)
    for n in (1, 3):
        names = [name for k, part in enumerate(causal_lm_parts(model, n))
                 for name in part_state_keys(part, k).values()]
        assert sorted(names) == sorted(model.state_dict()), (arch, n)


def test_the_loss_keeps_the_logits_dtype() -> None:
    """float64 logits give a float64 loss on both paths (transformers' own loss casts to float32); bf16 logits are
    upcast to float32 as transformers does."""
    model = tiny_llama(layers=2).double()
    ids, labels = token_batch(7, rows=4)
    labels[1, 4:] = -100
    logits = model(ids).logits
    want = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, 96), labels[:, 1:].reshape(-1))
    for targets in (labels, causal_lm_targets(labels)):
        loss = causal_lm_loss(logits, targets)
        assert loss.dtype == torch.float64 and rel(loss, want) <= 1e-15
    assert causal_lm_loss(logits.bfloat16(), causal_lm_targets(labels)).dtype == torch.float32
    assert model(ids, labels=labels).loss.dtype == torch.float32  # why: the library's loss casts down


def test_targets_take_the_job_totals() -> None:
    """Data parallelism: tokens and rows of the whole job make each replica's weight its share of the job's tokens."""
    labels = torch.tensor([[1, 2, -100, -100], [3, 4, 5, 6]])
    targets = causal_lm_targets(labels, tokens=10, rows=4)
    assert targets["batch_tokens"].tolist() == [10, 10] and targets["batch_rows"].tolist() == [4, 4]
    assert causal_lm_targets(labels)["batch_tokens"].tolist() == [4, 4]
