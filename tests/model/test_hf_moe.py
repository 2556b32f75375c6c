"""Tests for duplexpipe.model.hf_moe: transformers' MoE families as parts whose sparse blocks are duplexpipe.moe
layers, bit-equal to the models themselves (routing, experts, shared experts, the load-balancing loss with and
without padding, and every gradient), under the names the published checkpoints use."""

from __future__ import annotations

import pytest

pytest.importorskip("transformers")

from collections.abc import Iterator  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from _hf_helpers import (  # noqa: E402
    VOCAB,
    one_thread,
    padded_labels,
    padding_mask,
    rel,
    run_parts,
    token_batch,
    transformers,
)
from _hf_moe_helpers import AUX, FAMILIES, tiny_moe  # noqa: E402
from safetensors import safe_open  # noqa: E402
from torch import nn  # noqa: E402

from duplexpipe.model.hf import causal_lm_loss, causal_lm_parts, causal_lm_targets  # noqa: E402
from duplexpipe.model.hf_moe import HFMoELayer, set_bias_update_speed, with_moe_layers  # noqa: E402
from duplexpipe.model.state_names import part_state_keys  # noqa: E402
from duplexpipe.moe import moe_layers  # noqa: E402

CASES = [(f, aux, pad, 3) for f in FAMILIES for aux in ((False, True) if f != "deepseek_v3" else (False,))
         for pad in (False, True)] + [("qwen3_moe-dense-layer", True, True, 4)]
"""(family, aux loss on, padded batch, parts). "qwen3_moe-dense-layer": layer 2 a dense MLP (mlp_only_layers),
alone in its part, which passes the router sums on."""


def _global_grads(parts: list[nn.Module]) -> dict[str, torch.Tensor]:
    """Every parameter's gradient under its checkpoint name, Mixtral's `block_sparse_moe` as `mlp` (transformers'
    name in memory)."""
    out = {}
    for k, part in enumerate(parts):
        names = part_state_keys(part, k)
        out.update({names[n].replace(".block_sparse_moe.", ".mlp."): p.grad for n, p in part.named_parameters()})
    return out


def _fused_grad(grads: dict[str, torch.Tensor], name: str) -> torch.Tensor:
    """A transformers gradient of a fused expert tensor from the parts' per-expert ones."""
    prefix = name.rsplit(".experts.", 1)[0] + ".experts."
    count = len({k.split(prefix)[1].split(".")[0] for k in grads if k.startswith(prefix)})
    gate, up, down = (("w1", "w3", "w2") if f"{prefix}0.w1.weight" in grads else ("gate_proj", "up_proj", "down_proj"))
    if name.endswith("gate_up_proj"):
        return torch.stack([torch.cat([grads[f"{prefix}{e}.{gate}.weight"], grads[f"{prefix}{e}.{up}.weight"]])
                            for e in range(count)])
    return torch.stack([grads[f"{prefix}{e}.{down}.weight"] for e in range(count)])


@pytest.fixture(autouse=True)
def _one_thread() -> Iterator[None]:
    with one_thread():
        yield


@pytest.mark.parametrize("family, aux, padded, num_parts", CASES)
def test_parts_compute_what_the_model_computes(family: str, aux: bool, padded: bool, num_parts: int) -> None:
    """Logits and the aux loss (padding left out of it) bit-equal to the model in one process, the loss to the last
    bits of its cross entropy's sum, every gradient bit-equal but the experts' (formed per expert, not from the
    fused tensor: rel 1e-13)."""
    dense = {"mlp_only_layers": [2]} if family.endswith("-dense-layer") else {}
    model = tiny_moe(family.removesuffix("-dense-layer"), **(AUX if aux else {}), **dense)
    parts = causal_lm_parts(model, num_parts)
    ids, labels = token_batch(0)
    inputs = {"input_ids": ids}
    if padded:
        inputs["attention_mask"] = padding_mask(ids.shape[0], left=False)
        labels = padded_labels(ids, inputs["attention_mask"])
    want = model(**inputs, output_router_logits=aux)
    ce = F.cross_entropy(want.logits[:, :-1].reshape(-1, VOCAB), labels[:, 1:].reshape(-1), ignore_index=-100)
    total = ce + model.config.router_aux_loss_coef * want.aux_loss if aux else ce
    total.backward()
    out = run_parts(parts, inputs)
    assert isinstance(out, dict) == aux
    loss = causal_lm_loss(out, causal_lm_targets(labels))
    loss.backward()
    assert torch.equal(out["logits"] if aux else out, want.logits)
    if aux:
        assert torch.equal(out["aux_loss"], model.config.router_aux_loss_coef * want.aux_loss)
    assert abs(loss.item() - total.item()) <= 1e-15 * loss.item()
    grads = _global_grads(parts)
    for name, param in model.named_parameters():
        if ".experts." in name:
            assert rel(_fused_grad(grads, name), param.grad) <= 1e-13, name
        else:
            assert torch.equal(grads[name], param.grad), name


@pytest.mark.parametrize("family", FAMILIES)
def test_state_keys_are_the_published_names(family: str, tmp_path: Path) -> None:
    """The parts' checkpoint names are exactly what transformers' save_pretrained writes (each expert on its own,
    Mixtral's block_sparse_moe), and the user's model keeps its fused experts."""
    model = tiny_moe(family)
    model.save_pretrained(tmp_path)
    with safe_open(str(tmp_path / "model.safetensors"), framework="pt") as f:
        published = set(f.keys())  # noqa: SIM118 - safe_open has no __iter__
    parts = causal_lm_parts(model, 2)
    names = {n for k, part in enumerate(parts) for n in part_state_keys(part, k).values()}
    assert names - {"lm_head.weight"} == published - {"lm_head.weight"}
    assert not any(isinstance(m, HFMoELayer) for m in model.modules())
    assert any(k.endswith("experts.gate_up_proj") for k in model.state_dict())
    assert with_moe_layers(parts[0]) is parts[0]  # nothing left to convert


def test_dense_layers_and_attention_stay_transformers_own() -> None:
    """DeepSeek-V3's first dense layer and every attention are the model's modules (shared, as for dense models);
    the experts are new parameters copied out of the fused tensors."""
    model = tiny_moe("deepseek_v3")
    parts = causal_lm_parts(model, 2)
    layers = parts[0].layers
    assert layers["0"] is model.model.layers[0] and layers["1"].self_attn is model.model.layers[1].self_attn
    moe = layers["1"].mlp
    assert isinstance(moe, HFMoELayer) and moe.shared is model.model.layers[1].mlp.shared_experts
    assert [len(layer.experts) for layer in moe_layers(parts[0])] == [8]
    assert moe.router.groups == (4, 2) and moe.router.scale == 2.5 and moe.router.logits_dtype == torch.float32


def test_bias_update_speed_needs_a_router_with_a_bias() -> None:
    parts = causal_lm_parts(tiny_moe("deepseek_v3"), 1)
    set_bias_update_speed(parts[0], 0.01)
    assert {layer.bias_update_speed for layer in moe_layers(parts[0])} == {0.01}
    qwen = causal_lm_parts(tiny_moe("qwen3_moe"), 1)[0]
    with pytest.raises(ValueError, match="the qwen3_moe router has no expert bias"):
        set_bias_update_speed(qwen, 0.01)
    with pytest.raises(ValueError, match="must be >= 0, got -1"):
        set_bias_update_speed(qwen, -1)


def test_mixtral_router_jitter_is_refused() -> None:
    model = tiny_moe("mixtral", router_jitter_noise=0.1)
    with pytest.raises(ValueError, match="router_jitter_noise=0.1 is not supported"):
        causal_lm_parts(model, 2)


def test_unsupported_models_are_named() -> None:
    config = transformers.OlmoeConfig(hidden_size=16, intermediate_size=16, num_hidden_layers=2, num_attention_heads=2,
                                      num_experts=4, num_experts_per_tok=2, vocab_size=VOCAB)
    with pytest.raises(ValueError, match="does not support OlmoeForCausalLM; supported: .*DeepseekV3ForCausalLM"):
        causal_lm_parts(transformers.OlmoeForCausalLM(config), 2)


def test_without_autograd_the_parts_pass_no_router_sums() -> None:
    """Evaluation (no autograd): hidden states between parts and logits at the end, the aux loss left out."""
    model = tiny_moe("qwen3_moe", **AUX)
    parts = causal_lm_parts(model, 2)
    ids, _ = token_batch(0)
    with torch.no_grad():
        middle = parts[0](ids)
        out = parts[1](middle)
    assert isinstance(middle, torch.Tensor) and isinstance(out, torch.Tensor)
    assert torch.equal(out, model(ids).logits)
