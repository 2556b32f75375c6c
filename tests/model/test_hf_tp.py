"""Tests for duplexpipe.model.hf_tp: a Llama and a Qwen3 from `Pipeline.from_pretrained` at PP=2 x TP=2 (4 gloo ranks,
float64) with the plan transformers publishes, 5 AdamW steps against plain transformers training in one process,
with and without sequence parallelism and padding; save_pretrained writes whole tensors transformers loads; the
model's heads and GPT-2's packed attention are refused with a clear error. A Qwen3-MoE (its sparse blocks whole, the
experts spread by expert parallelism) at PP=2 x TP=2 and at PP=1 x DP=2 x TP=2 with ep=2, and refused with
sequence parallelism."""

from __future__ import annotations

import pytest

pytest.importorskip("transformers")

from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

import torch  # noqa: E402
from _hf_helpers import (  # noqa: E402
    adamw,
    lm_batch,
    rel,
    tiny_gpt2,
    tiny_llama,
    tiny_qwen3,
    train_transformers,
    transformers,
)
from _hf_moe_helpers import tiny_moe  # noqa: E402
from models import run_workers  # noqa: E402
from torch import nn  # noqa: E402

from duplexpipe import Pipeline, PipelineConfig, make_mesh  # noqa: E402
from duplexpipe.model.hf import causal_lm_parts  # noqa: E402
from duplexpipe.model.hf_tp import HFTensorPlan, part_plan, published_plan  # noqa: E402

STEPS, ROWS = 5, 8
CASES = {"llama": (False, True), "qwen3 sp": (True, True), "llama97 sp": (True, True)}
"""name -> (sequence parallelism, padded batches); the model folder is the name's first word (llama97: a
vocabulary of 97 tokens, split 49 + 48 over the two TP ranks)."""
MOE_CASES = {"qwen3_moe": (2, 1, 1), "qwen3_moe ep": (1, 2, 2)}
"""name -> (pp, dp, ep) of a Qwen3-MoE run with TP=2 (no sequence parallelism, no padding)."""


def _worker(rank: int, world: int, root: str) -> dict[str, Any]:
    transformers.logging.set_verbosity_error()
    out: dict[str, Any] = {}
    for name, (sp, padded) in CASES.items():
        pipe = Pipeline.from_pretrained(Path(root) / name.split()[0], adamw,
                                        PipelineConfig("1f1b", 4, sequence_parallel=sp), mesh=make_mesh(2, tp=2))
        out[name] = [pipe.step(*lm_batch(step, ROWS, padded)) for step in range(STEPS)]
        pipe.save_pretrained(Path(root) / f"out-{name}")
    for name, (pp, dp, ep) in MOE_CASES.items():
        pipe = Pipeline.from_pretrained(Path(root) / "qwen3_moe", adamw, PipelineConfig("1f1b", 4),
                                        mesh=make_mesh(pp, dp, tp=2, ep=ep))
        lo, rows = pipe.groups.dp_rank * ROWS // dp, ROWS // dp
        out[name] = [pipe.step(ids[lo:lo + rows], labels[lo:lo + rows])
                     for ids, labels in (lm_batch(step, ROWS, False) for step in range(STEPS))]
        pipe.save_pretrained(Path(root) / f"out-{name}")
    try:
        Pipeline.from_pretrained(Path(root) / "llama", adamw, PipelineConfig("1f1b", 4), mesh=make_mesh(1, tp=4))
    except ValueError as exc:
        out["kv heads"] = str(exc)
    return out


def _reference(source: Path, padded: bool) -> tuple[list[float], nn.Module]:
    """STEPS of plain transformers training in one process (the loss in float64, as the pipeline computes it)."""
    moe = {"experts_implementation": "eager"} if source.name == "qwen3_moe" else {}  # float64 experts on the CPU
    model = transformers.AutoModelForCausalLM.from_pretrained(source, **moe)
    return train_transformers(model, STEPS, ROWS, padded), model


@pytest.fixture(scope="module")
def spawned(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[dict[str, Any]]]:
    root = tmp_path_factory.mktemp("hf-tp")
    transformers.logging.set_verbosity_error()
    tiny_llama(layers=2).double().save_pretrained(root / "llama")
    tiny_qwen3(layers=2).double().save_pretrained(root / "qwen3")
    tiny_llama(layers=2, vocab_size=97).double().save_pretrained(root / "llama97")
    tiny_moe("qwen3_moe", layers=2).save_pretrained(root / "qwen3_moe")
    return root, run_workers(_worker, 4, (str(root),), timeout_s=360)


@pytest.mark.timeout(400)
@pytest.mark.parametrize("name", [*CASES, *MOE_CASES])
def test_tp_fine_tuning_equals_transformers_and_saves_whole_tensors(spawned: Any, name: str) -> None:
    root, results = spawned
    losses, reference = _reference(root / name.split()[0], name in CASES and CASES[name][1])
    for res in results:
        assert max(abs(a - b) / b for a, b in zip(res[name], losses, strict=True)) <= 1e-9, (res[name], losses)
    moe = {"experts_implementation": "eager"} if name in MOE_CASES else {}
    trained = transformers.AutoModelForCausalLM.from_pretrained(root / f"out-{name}", **moe)
    want = reference.state_dict()
    assert set(trained.state_dict()) == set(want)
    for key, tensor in trained.state_dict().items():
        assert tensor.shape == want[key].shape and tensor.dtype == torch.float64, key
        assert rel(tensor, want[key]) <= 1e-9, key


@pytest.mark.timeout(400)
def test_heads_not_divisible_by_tp_are_refused_naming_module_size_and_degree(spawned: Any) -> None:
    _, results = spawned
    for res in results:
        assert "'layers.*.self_attn' (LlamaForCausalLM) has num_key_value_heads=2, not divisible by the TP " \
               "degree 4" in res["kv heads"]


def test_the_published_plan_is_mapped_not_rederived() -> None:
    transformers.logging.set_verbosity_error()
    qwen = causal_lm_parts(tiny_qwen3(layers=2), 2)
    assert published_plan(qwen[0])["layers.*.self_attn.q_norm"] == "replicated_with_grad_allreduce"
    assert published_plan(qwen[1])["lm_head"] == "colwise_gather_output"
    assert set(part_plan(qwen[0], False)) == {"embed_tokens", *(k for k in published_plan(qwen[0])
                                                                if k.startswith("layers."))}
    assert set(part_plan(qwen[1], True)) >= {"lm_head", "norm", "layers.*.input_layernorm", "layers.*.self_attn"}
    with pytest.raises(ValueError, match="GPT2LMHeadModel has no tensor-parallel plan.*packs q, k and v"):
        HFTensorPlan().check(causal_lm_parts(tiny_gpt2(layers=2), 2), 2)


def test_an_moe_model_shards_its_attention_and_keeps_its_sparse_blocks_whole() -> None:
    """Qwen3-MoE: the published entries inside the sparse blocks (fused experts) are left out, the attention is
    sharded as published; sequence parallelism is refused by name."""
    transformers.logging.set_verbosity_error()
    parts = causal_lm_parts(tiny_moe("qwen3_moe", layers=2), 2)
    assert set(part_plan(parts[0], False)) == {"embed_tokens", *(k for k in published_plan(parts[0])
                                                                 if k.startswith("layers.*.self_attn."))}
    with pytest.raises(ValueError, match="Qwen3MoeForCausalLM's sparse blocks run whole on every TP rank"):
        HFTensorPlan(sequence_parallel=True).check(parts, 2)
