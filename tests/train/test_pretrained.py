"""Tests for duplexpipe.train.pretrained and train.checkpoint.hf_export: Hugging Face directories in and out of a
pipeline (bit-equal round trips, fine-tuning equal to transformers in one process, each rank reading only its own
tensors)."""

from __future__ import annotations

import pytest

pytest.importorskip("transformers")

import json  # noqa: E402
import re  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

import torch  # noqa: E402
from _hf_helpers import (  # noqa: E402
    BUILDERS,
    adamw,
    char_tokenizer,
    file_sizes,
    file_tensors,
    lm_batch,
    own_bytes,
    peak_bytes,
    rel,
    tiny_llama,
    train_transformers,
    transformers,
)
from models import run_workers  # noqa: E402
from torch import nn  # noqa: E402

from duplexpipe.dp_options.zero import ZeroOptions  # noqa: E402
from duplexpipe.parallel.mesh import make_mesh  # noqa: E402
from duplexpipe.train.checkpoint import read_checkpoint  # noqa: E402
from duplexpipe.train.float8 import float8_linears  # noqa: E402
from duplexpipe.train.pipeline_config import DataParallelConfig, PrecisionConfig  # noqa: E402
from duplexpipe.train.pretrained import PretrainedModel  # noqa: E402
from duplexpipe.train.trainer import Pipeline, PipelineConfig  # noqa: E402

ROUND_TRIPS = [("llama", "1f1b"), ("llama", "dualpipe"), ("llama", "dualpipev"), ("gpt2", "1f1b"),
               ("gpt2", "dualpipe"), ("gpt2", "dualpipev"), ("mistral", "1f1b"), ("qwen2", "1f1b"),
               ("qwen3", "1f1b"), ("llama_tied", "dualpipe")]
"""(architecture, schedule) loaded with from_pretrained and saved with save_pretrained, untrained."""
FINE_TUNES = {"llama": ("1f1b", 2, 1, True, 0), "gpt2": ("dualpipe", 2, 1, False, 0),
              "llama-dp2": ("1f1b", 1, 2, True, 0)}
"""name -> (schedule, pp, dp, padded, zero stage): five AdamW steps, then save_pretrained."""
STEPS, ROWS = 5, 8
TEXT = "In the beginning God created the heaven and the earth.\n"


def _rows(value: Any, lo: int, hi: int) -> Any:
    return {k: v[lo:hi] for k, v in value.items()} if isinstance(value, dict) else value[lo:hi]


def _worker(rank: int, world: int, root: str) -> dict[str, Any]:
    transformers.logging.set_verbosity_error()
    torch.set_num_threads(1)
    base = Path(root)
    out: dict[str, Any] = {}
    for arch, schedule in ROUND_TRIPS:
        pipe = Pipeline.from_pretrained(base / arch, adamw, PipelineConfig(schedule, 4))
        pipe.save_pretrained(base / f"rt-{arch}-{schedule}")
    for name, (schedule, pp, dp, padded, zero) in FINE_TUNES.items():
        mesh = make_mesh(pp, dp) if dp > 1 else None
        pipe = Pipeline.from_pretrained(base / name.split("-")[0], adamw, PipelineConfig(schedule, 4,
                                                                                         data_parallel=DataParallelConfig(zero_stage=zero)),
                                        mesh=mesh)
        rows = ROWS // dp
        lo = pipe.groups.dp_rank * rows
        losses = []
        for step in range(STEPS):
            inputs, labels = lm_batch(step, ROWS, padded)
            losses.append(pipe.step(_rows(inputs, lo, lo + rows), labels[lo:lo + rows]))
        pipe.save_pretrained(base / f"ft-{name}")
        out[f"ft-{name}"] = losses
    pipe, peak = peak_bytes(lambda: Pipeline.from_pretrained(base / "big", adamw, PipelineConfig("1f1b", 4)),
                            file_sizes(base / "big"))
    out["memory"] = (peak, *own_bytes(pipe))
    for name, config in SHARDED.items():
        out[f"{name}_params_kept"] = _export_sharded(base, name, config)
    pipe = Pipeline.from_pretrained(base / "big", adamw, PipelineConfig("1f1b", 4, precision=PrecisionConfig(
        float8="tensorwise")), dtype=torch.float32)
    out["float8_linears"] = len(float8_linears(pipe.stage_modules.values()))
    pipe.save_pretrained(base / "float8-big")
    return out


SHARDED = {"qwz": PipelineConfig("1f1b", 4, data_parallel=DataParallelConfig(zero_stage=1,
                                                                             zero=ZeroOptions(quantized_weights=True))),
           "zero2": PipelineConfig("1f1b", 4, data_parallel=DataParallelConfig(zero_stage=2)),
           "zero3": PipelineConfig("1f1b", 4, data_parallel=DataParallelConfig(zero_stage=3))}
"""Sharded weights on PP=1 x DP=2 (float32 GPT-2): ZeRO-1 with int8 weights (qwZ: the exact weights are the
optimizer's master shards), ZeRO-2 and ZeRO-3 (FSDP2's sharded DTensors, gathered one tensor at a time)."""


def _export_sharded(base: Path, name: str, config: PipelineConfig) -> bool:
    """Two steps, then save_pretrained and a checkpoint of the same moment; True when the parameters are as before
    save_pretrained (qwZ: dequantized values, restored after exporting the masters)."""
    pipe = Pipeline.from_pretrained(base / "gpt2", adamw, config, mesh=make_mesh(1, 2), dtype=torch.float32)
    for step in range(2):
        inputs, labels = lm_batch(step, ROWS, False)
        lo = pipe.groups.dp_rank * ROWS // 2
        pipe.step(inputs[lo:lo + ROWS // 2], labels[lo:lo + ROWS // 2])
    before = [p.detach().clone() for p in pipe.params]
    pipe.save_pretrained(base / name)
    pipe.save(str(base / f"{name}-checkpoint"))
    return all(torch.equal(a, b) for a, b in zip(before, pipe.params, strict=True))


def _sources(root: Path) -> dict[str, nn.Module]:
    """Tiny models saved by transformers in float64 (the Llama one sharded, with a tokenizer; "big" for memory)."""
    models = {arch: BUILDERS[arch](layers=4).double() for arch in ("llama", "gpt2", "mistral", "qwen2", "qwen3")}
    models["llama_tied"] = tiny_llama(layers=4, tie_word_embeddings=True).double()
    models["big"] = tiny_llama(layers=4, hidden_size=64, intermediate_size=128, vocab_size=512).double()
    for arch, model in models.items():
        model.save_pretrained(root / arch, max_shard_size="40KB" if arch == "llama" else "50GB")
    char_tokenizer(TEXT).save_pretrained(root / "llama")
    return models


@pytest.fixture(scope="module")
def spawned(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, nn.Module], list[dict[str, Any]]]:
    root = tmp_path_factory.mktemp("hf")
    transformers.logging.set_verbosity_error()
    models = _sources(root)
    return root, models, run_workers(_worker, 2, (str(root),), timeout_s=300)


@pytest.mark.timeout(330)
@pytest.mark.parametrize("arch, schedule", ROUND_TRIPS)
def test_round_trip_is_bit_equal_and_loads_in_transformers(spawned: Any, arch: str, schedule: str) -> None:
    root, models, _ = spawned
    out = root / f"rt-{arch}-{schedule}"
    want = models[arch].state_dict()
    stored = file_tensors(out)
    assert set(stored) == set(file_tensors(root / arch)), "the same names as transformers stores (tied weights once)"
    for name, tensor in stored.items():
        assert tensor.dtype == torch.float64 and torch.equal(tensor, want[name]), name
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert sorted(set(index["weight_map"].values())) == ["model-00001-of-00002.safetensors",
                                                         "model-00002-of-00002.safetensors"]  # one shard per rank
    assert json.loads((out / "config.json").read_text())["dtype"] == "float64"
    back = transformers.AutoModelForCausalLM.from_pretrained(out)
    assert back.dtype == torch.float64 and type(back) is type(models[arch])
    for name, tensor in back.state_dict().items():
        assert torch.equal(tensor, want[name]), name
    if arch == "gpt2":
        assert back.lm_head.weight is back.transformer.wte.weight
    if arch == "llama_tied":
        assert back.lm_head.weight is back.model.embed_tokens.weight and "lm_head.weight" not in stored
    if arch == "llama":  # the source's tokenizer and generation files come along
        assert (out / "tokenizer.json").read_bytes() == (root / "llama" / "tokenizer.json").read_bytes()
        assert (out / "generation_config.json").is_file()


def _reference(source: Path, padded: bool) -> tuple[list[float], nn.Module]:
    """STEPS of plain transformers training in one process, float64."""
    model = transformers.AutoModelForCausalLM.from_pretrained(source)
    assert model.dtype == torch.float64
    return train_transformers(model, STEPS, ROWS, padded), model


@pytest.mark.timeout(330)
@pytest.mark.parametrize("name", list(FINE_TUNES))
def test_fine_tuning_equals_transformers_training_in_one_process(spawned: Any, name: str) -> None:
    root, models, results = spawned
    source = models[name.split("-")[0]]
    losses, reference = _reference(root / name.split("-")[0], FINE_TUNES[name][3])
    for res in results:
        got = res[f"ft-{name}"]
        assert max(abs(a - b) / b for a, b in zip(got, losses, strict=True)) <= 1e-12, (got, losses)
    trained = transformers.AutoModelForCausalLM.from_pretrained(root / f"ft-{name}")
    want = reference.state_dict()
    assert rel(torch.cat([t.flatten() for t in trained.state_dict().values()]),
               torch.cat([want[k].flatten() for k in trained.state_dict()])) <= 1e-9
    for key, tensor in trained.state_dict().items():
        assert rel(tensor, want[key]) <= 1e-9, key
    moved = rel(torch.cat([want[k].flatten() for k in trained.state_dict()]),
                torch.cat([source.state_dict()[k].flatten() for k in trained.state_dict()]))
    assert moved > 1e-3, moved  # the steps changed the weights: the comparison is not vacuous


@pytest.mark.timeout(330)
def test_each_rank_reads_only_its_own_parts(spawned: Any) -> None:
    """Peak CPU bytes during from_pretrained: this rank's parts and one tensor in flight, never the whole model."""
    root, models, results = spawned
    whole = sum(t.numel() * t.element_size() for t in models["big"].state_dict().values())
    for peak, own, largest in (res["memory"] for res in results):
        assert own < 0.7 * whole, (own, whole)
        assert own <= peak <= own + largest + 64 * 1024, (peak, own, largest, whole)
    _, control = peak_bytes(lambda: transformers.AutoModelForCausalLM.from_pretrained(root / "big"))
    assert control >= whole, (control, whole)  # the measure sees a whole-model load as one


@pytest.mark.timeout(330)
@pytest.mark.parametrize("name", list(SHARDED))
def test_sharded_weights_export_whole_and_exact(spawned: Any, name: str) -> None:
    """The exported tensors are the whole, exact weights: those the checkpoint of the same moment holds (qwZ: the
    full-precision masters, not the dequantized parameters; ZeRO-2: FSDP's shards put together)."""
    root, models, results = spawned
    assert all(res[f"{name}_params_kept"] for res in results), "the parameters are as before the export"
    exported = file_tensors(root / name)
    saved = {k[len("model."):]: v for k, v in read_checkpoint(str(root / f"{name}-checkpoint")).items()
             if k.startswith("model.")}
    assert set(exported) == set(saved) - {"lm_head.weight"}  # tied: stored once
    for key, tensor in exported.items():
        assert tensor.dtype == torch.float32 and torch.equal(tensor, saved[key]), key
    start = models["gpt2"].state_dict()["transformer.h.0.mlp.c_fc.weight"].float()
    assert not torch.equal(exported["transformer.h.0.mlp.c_fc.weight"], start)  # it trained


@pytest.mark.timeout(330)
def test_zero3_export_equals_zero2s(spawned: Any) -> None:
    """ZeRO-3 trains bit-equal to ZeRO-2 here, so its export (each parameter gathered alone) is the same files'
    tensors."""
    root, _, _ = spawned
    zero2, zero3 = file_tensors(root / "zero2"), file_tensors(root / "zero3")
    assert set(zero3) == set(zero2) and all(torch.equal(zero3[k], zero2[k]) for k in zero2)


def test_bad_model_directories_are_named(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    with pytest.raises(ValueError, match="is not a model directory .no config.json."):
        Pipeline.from_pretrained(tmp_path / "nowhere", adamw)
    (tmp_path / "bert").mkdir()
    (tmp_path / "bert" / "config.json").write_text(json.dumps({"model_type": "bert"}))
    with pytest.raises(ValueError, match="model_type 'bert' is not supported; supported: deepseek_v3, gpt2, llama"):
        PretrainedModel.open(tmp_path / "bert")
    model = tiny_llama(layers=2)
    model.save_pretrained(tmp_path / "llama")
    (tmp_path / "llama" / "model.safetensors").rename(tmp_path / "weights.bin")
    with pytest.raises(ValueError, match="holds no safetensors weights"):
        PretrainedModel.open(tmp_path / "llama")
    other = tiny_llama(layers=3)
    other.save_pretrained(tmp_path / "three")
    (tmp_path / "three" / "model.safetensors").rename(tmp_path / "llama" / "model.safetensors")
    PretrainedModel.open(tmp_path / "llama")  # a layer the config lacks: ignored with a warning, as transformers does
    assert "9 tensors the model does not use are ignored (model.layers.2." in caplog.text
    config = json.loads((tmp_path / "three" / "config.json").read_text())
    (tmp_path / "llama" / "config.json").write_text(json.dumps({**config, "num_hidden_layers": 4}))
    with pytest.raises(ValueError, match=r"9 tensors missing \(model.layers.3.*\), 0 unexpected"):
        PretrainedModel.open(tmp_path / "llama")
    (tmp_path / "llama" / "config.json").write_text(json.dumps({**config, "intermediate_size": 32}))
    with pytest.raises(ValueError, match=r"model.layers.0.mlp.gate_proj.weight has shape \(64, 32\), the config gives "
                       r"\(32, 32\)"):
        PretrainedModel.open(tmp_path / "llama")


@pytest.mark.parametrize("case, expected", [
    ("bool-weight", "model.layers.0.mlp.up_proj.weight is stored as torch.bool, but the model's"),
    ("int64-weight", "model.layers.0.mlp.up_proj.weight is stored as torch.int64, but the model's"),
    ("hidden_size=-64", "config.json: hidden_size must be a whole number >= 1, got -64"),
    ("num_hidden_layers=1000000", "config.json: num_hidden_layers 1,000,000 is over 4,096 decoder layers"),
    ("num_attention_heads=0", "config.json: not a valid config (ZeroDivisionError"),
    ("shard-left-out", "does not match its config: 3 tensors missing"),
    ("shard-missing", "model.safetensors.index.json names files that are not there"),
])
def test_crafted_model_folders_are_refused_naming_the_tensor_or_field(case: str, expected: str,
                                                                      tmp_path: Path) -> None:
    """A float weight stored as bool or integers, a config's impossible or enormous size, a shard left out of the
    index or missing: refused when the folder is opened (before any layer is built or weight cast)."""
    from safetensors.torch import load_file, save_file

    root = tmp_path / "model"
    model = tiny_llama(layers=2)
    model.save_pretrained(root, max_shard_size="20KB" if case.startswith("shard") else "5GB")
    if case.endswith("-weight"):
        tensors = load_file(root / "model.safetensors")
        name = "model.layers.0.mlp.up_proj.weight"
        tensors[name] = (tensors[name] > 0).to(torch.bool if case.startswith("bool") else torch.int64)
        save_file(tensors, str(root / "model.safetensors"), metadata={"format": "pt"})
    elif "=" in case:
        key, value = case.split("=")
        config = json.loads((root / "config.json").read_text())
        (root / "config.json").write_text(json.dumps({**config, key: int(value)}))
    else:
        index = json.loads((root / "model.safetensors.index.json").read_text())
        files = sorted(set(index["weight_map"].values()))
        if case == "shard-missing":
            (root / files[-1]).unlink()
        else:  # the first shard's tensors taken out of the index, its file still there
            index["weight_map"] = {k: v for k, v in index["weight_map"].items() if v != files[0]}
            (root / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(ValueError, match=re.escape(expected)):
        PretrainedModel.open(root)


def test_a_float8_pipeline_exports_its_high_precision_weights_under_the_same_names(spawned: Any) -> None:
    """Float8 compute keeps the high-precision weights: what save_pretrained writes is the loaded float32 model."""
    root, models, results = spawned
    assert all(r["float8_linears"] > 0 for r in results), "each rank converted some linears"
    stored, want = file_tensors(root / "float8-big"), models["big"].state_dict()
    assert set(stored) == set(file_tensors(root / "big"))
    for name, tensor in stored.items():
        assert tensor.dtype == torch.float32 and torch.equal(tensor, want[name].float()), name
