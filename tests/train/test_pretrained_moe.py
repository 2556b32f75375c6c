"""Hugging Face MoE checkpoints (Qwen3-MoE, Qwen2-MoE, Mixtral, DeepSeek-V3) in a pipeline with expert parallelism:
PP=2 x DP=2 with ep=2 (4 gloo ranks, float64) against one-process transformers training (DualPipeV and 1F1B, the
aux loss off and on, the F&B overlap on and off bit-equal, a router steered so that one expert-parallel rank gets
no token, DeepSeek-V3's expert-bias update), bit-equal round trips from the published and the fused layouts,
a checkpoint saved at ep=2 resumed at ep=1 on PP=4, each rank reading only its own parts and experts, and the
errors of a bad checkpoint or layout."""

from __future__ import annotations

import pytest

pytest.importorskip("transformers")

import functools  # noqa: E402
import json  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

import torch  # noqa: E402
from _hf_helpers import (  # noqa: E402
    adamw,
    char_tokenizer,
    file_sizes,
    file_tensors,
    one_thread,
    own_bytes,
    peak_bytes,
    rel,
    token_batch,
    transformers,
)
from _hf_moe_helpers import AUX, save_fused, save_published, set_config, steer, tiny_moe  # noqa: E402
from models import run_workers  # noqa: E402
from safetensors.torch import save_file  # noqa: E402
from torch import nn  # noqa: E402

from duplexpipe.cli.main import main  # noqa: E402
from duplexpipe.model.hf import causal_lm_loss, causal_lm_targets, counted_tokens  # noqa: E402
from duplexpipe.model.state_names import part_state_keys  # noqa: E402
from duplexpipe.parallel.mesh import make_mesh  # noqa: E402
from duplexpipe.train.pipeline_config import DataParallelConfig  # noqa: E402
from duplexpipe.train.pretrained import PretrainedModel  # noqa: E402
from duplexpipe.train.trainer import Pipeline, PipelineConfig  # noqa: E402

FAMILIES = ("qwen3_moe", "qwen2_moe", "mixtral", "deepseek_v3")
WITH_AUX = ("qwen3_moe", "qwen2_moe", "mixtral")
"""The families whose transformers model has a load-balancing loss (DeepSeek-V3's has none)."""
STEPS, ROWS, MICRO, SPEED = 5, 16, 4, 1e-3
CHUNKS = 2 * MICRO
"""Microbatches of a step over both data-parallel replicas (each its own load-balancing loss)."""
RUNS: dict[str, tuple[str, str, dict[str, Any]]] = {
    **{f"{f} {s}": (f, s, {}) for f in FAMILIES for s in ("dualpipev", "1f1b")},
    **{f"{f}-aux {s}": (f"{f}-aux", s, {}) for f in WITH_AUX for s in ("dualpipev", "1f1b")},
    **{f"{f} dualpipev no-overlap": (f if f == "deepseek_v3" else f"{f}-aux", "dualpipev", {"fb_overlap": False})
       for f in FAMILIES},
    "deepseek_v3-steered dualpipev": ("deepseek_v3-steered", "dualpipev", {}),
    "deepseek_v3 dualpipev bias": ("deepseek_v3", "dualpipev", {"speed": SPEED}),
}
"""name -> (source, schedule, options): five AdamW steps at PP=2 x DP=2, ep=2, then save_pretrained."""
ROUND_TRIPS = (*FAMILIES, "qwen3_moe-fused", "mixtral-fused")
ZERO_ROUND_TRIPS = (2, 3)
"""zero_stage of the round trips at PP1 x DP4 with ep=2 (every parameter an FSDP DTensor, the experts' over their
expert-data-parallel group)."""
SPAWN_TIMEOUT_S = 400


def _train(root: Path, name: str, pipe: Pipeline, steps: range) -> list[float]:
    losses = []
    rows = ROWS // pipe.groups.dp_size
    lo = pipe.groups.dp_rank * rows
    for step in steps:
        ids, labels = token_batch(step, rows=ROWS)
        losses.append(pipe.step(ids[lo:lo + rows], labels[lo:lo + rows]))
    pipe.save_pretrained(root / f"ft-{name}")
    return losses


def _resume(root: Path) -> list[float]:
    """DeepSeek-V3 with its expert bias moving: 3 steps at PP=2 x DP=2 with ep=2 (DualPipeV), saved; resumed at
    PP=4 x DP=1 (ep=1, 1F1B, every expert on every rank) for 2 more, in microbatches of the same rows (its router
    projects in float32: a matmul over other rows may round its last bit otherwise)."""
    config = PipelineConfig("dualpipev", MICRO)
    pipe = Pipeline.from_pretrained(root / "deepseek_v3", adamw, config, mesh=make_mesh(2, 2, ep=2),
                                    router_bias_update_speed=SPEED)
    losses = _train(root, "resume-first", pipe, range(3))
    pipe.save(str(root / "resume-checkpoint"))
    pipe = Pipeline.from_pretrained(root / "deepseek_v3", adamw, PipelineConfig("1f1b", CHUNKS), mesh=make_mesh(4, 1),
                                    router_bias_update_speed=SPEED)
    pipe.load(str(root / "resume-checkpoint"))
    return losses + _train(root, "resume", pipe, range(3, STEPS))


def _memory(root: Path) -> tuple[int, int, int, list[str]]:
    """Peak CPU bytes during from_pretrained (PP=2 x DP=2, ep=2), this rank's bytes, its largest tensor and the
    checkpoint names of what it holds."""
    pipe, peak = peak_bytes(lambda: Pipeline.from_pretrained(root / "big", adamw, PipelineConfig("1f1b", MICRO),
                                                               mesh=make_mesh(2, 2, ep=2)), file_sizes(root / "big"))
    names = [n for s, m in pipe.stage_state_modules.items()
             for n in part_state_keys(m, pipe.schedule.stages[s].group).values()]
    return (peak, *own_bytes(pipe), names)


def _worker(rank: int, world: int, root_text: str) -> dict[str, Any]:
    transformers.logging.set_verbosity_error()
    torch.set_num_threads(1)
    root = Path(root_text)
    out: dict[str, Any] = {"memory": _memory(root)}
    for source in ROUND_TRIPS:
        pipe = Pipeline.from_pretrained(root / source, adamw, PipelineConfig("1f1b", MICRO),
                                        mesh=make_mesh(2, 2, ep=2))
        pipe.save_pretrained(root / f"rt-{source}")
    for zero in ZERO_ROUND_TRIPS:  # PP1 x DP4, ep=2: the experts sharded over their two replicas
        pipe = Pipeline.from_pretrained(root / "qwen3_moe", adamw, PipelineConfig(
            "1f1b", MICRO, data_parallel=DataParallelConfig(zero_stage=zero)), mesh=make_mesh(1, 4, ep=2))
        pipe.save_pretrained(root / f"rt-zero{zero}")
    for name, (source, schedule, options) in RUNS.items():
        options = dict(options)
        speed = options.pop("speed", 0.0)
        pipe = Pipeline.from_pretrained(root / source, adamw, PipelineConfig(schedule, MICRO, **options),
                                        mesh=make_mesh(2, 2, ep=2), router_bias_update_speed=speed)
        out[name] = {"losses": _train(root, name, pipe, range(STEPS)), "overlap": pipe.runtime.config.fb_overlap,
                     "experts": sorted({int(k.split("experts.")[1].split(".")[0]) for m in pipe.stage_modules.values()
                                        for k in m.state_dict() if ".experts." in k})}
    out["resume"] = _resume(root)
    return out


def _sources(root: Path) -> None:
    """The tiny models as transformers saves them (every expert on its own, as published), the aux-loss variants
    (the same weights, output_router_logits on), DeepSeek-V3 steered away from experts 4..7, two in the fused
    layout, and a wider Qwen3-MoE for the memory measure."""
    for family in FAMILIES:
        model = tiny_moe(family)
        save_published(model, root / family)
        if family in WITH_AUX:
            save_published(model, root / f"{family}-aux")
            set_config(root / f"{family}-aux", **AUX)
        if family in ("qwen3_moe", "mixtral"):
            save_fused(model, root / f"{family}-fused")
    steered = tiny_moe("deepseek_v3")
    steer(steered, range(4, 8))
    save_published(steered, root / "deepseek_v3-steered")
    save_published(tiny_moe("qwen3_moe", hidden_size=64, moe_intermediate_size=64, num_experts=8, vocab_size=256,
                            head_dim=16), root / "big")


@pytest.fixture(scope="module")
def spawned(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[dict[str, Any]]]:
    root = tmp_path_factory.mktemp("hf-moe")
    transformers.logging.set_verbosity_error()
    _sources(root)
    return root, run_workers(_worker, 4, (str(root),), timeout_s=SPAWN_TIMEOUT_S)


def _close(got: torch.Tensor, want: torch.Tensor) -> bool:
    """Equal to rel 1e-9 (zeros: exactly)."""
    return torch.equal(got, want) or rel(got, want) <= 1e-9


def _load(path: Path) -> nn.Module:
    model, info = transformers.AutoModelForCausalLM.from_pretrained(path, experts_implementation="eager",
                                                                   output_loading_info=True)
    assert not any(info.values()), info  # every tensor in the files, none left over
    return model


@pytest.mark.timeout(SPAWN_TIMEOUT_S + 30)
@pytest.mark.parametrize("source", ROUND_TRIPS)
def test_round_trip_gives_back_every_tensor(spawned: Any, source: str) -> None:
    """from_pretrained then save_pretrained, untrained, with the experts spread over two ranks: the published names
    (each expert under its global index), every tensor bit-equal, and transformers loads it."""
    root, _ = spawned
    published = root / source.removesuffix("-fused")
    want, got = file_tensors(published), file_tensors(root / f"rt-{source}")
    assert set(got) == set(want)
    for name, tensor in want.items():
        assert got[name].dtype == torch.float64 and torch.equal(got[name], tensor), name
    index = json.loads((root / f"rt-{source}" / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) == 4  # a shard per pipeline rank and expert-parallel rank
    model, reference = _load(root / f"rt-{source}"), _load(published)
    assert type(model) is type(reference)
    for name, tensor in reference.state_dict().items():
        assert torch.equal(model.state_dict()[name], tensor), name


@pytest.mark.timeout(SPAWN_TIMEOUT_S + 30)
@pytest.mark.parametrize("zero", ZERO_ROUND_TRIPS)
def test_round_trip_under_zero_with_sharded_experts(spawned: Any, zero: int) -> None:
    """from_pretrained then save_pretrained at ZeRO-2/3 with two replicas per expert: every DTensor is gathered by
    every rank of its mesh (the ranks writing only experts too), and every tensor comes back bit-equal."""
    root, _ = spawned
    want, got = file_tensors(root / "qwen3_moe"), file_tensors(root / f"rt-zero{zero}")
    assert set(got) == set(want)
    for name, tensor in want.items():
        assert torch.equal(got[name], tensor), name


def _counting(model: nn.Module) -> list[torch.Tensor]:
    """Per DeepSeek-V3 router of `model`: the tokens each expert gets, counted by a forward hook (zeros to start)."""
    routers = [m for m in model.modules() if hasattr(m, "e_score_correction_bias")]
    loads = [torch.zeros(m.num_experts, dtype=torch.float64) for m in routers]
    for router, load in zip(routers, loads, strict=True):
        router.register_forward_hook(functools.partial(_count, load))
    return loads


def _count(load: torch.Tensor, _module: nn.Module, _inputs: Any, out: Any) -> None:
    load.add_(torch.bincount(out[2].flatten(), minlength=load.numel()))


class References:
    """`_trained` on one thread, once per source and speed (the schedules and the overlap runs of one source share
    it)."""

    def __init__(self) -> None:
        self.trained: dict[tuple[Path, float], tuple[list[float], nn.Module, torch.Tensor]] = {}

    def of(self, source: Path, speed: float = 0.0) -> tuple[list[float], nn.Module, torch.Tensor]:
        """The one-process training of `source` with expert-bias speed `speed`."""
        if (source, speed) not in self.trained:
            with one_thread():
                self.trained[source, speed] = _trained(source, speed)
        return self.trained[source, speed]


@pytest.fixture(scope="module")
def references() -> References:
    """The module's one-process trainings."""
    return References()


def _trained(source: Path, speed: float) -> tuple[list[float], nn.Module, torch.Tensor]:
    """STEPS of one-process transformers training (eager experts, float64): each step's batch in the pipeline's
    microbatches (each its own load-balancing loss when the config asks for it), the cross entropy over the whole
    batch's tokens in float64; with `speed`, DeepSeek-V3's expert bias moved after each step by speed x
    sign(mean load - load). Also the tokens each expert of each DeepSeek-V3 layer got over the steps."""
    model = transformers.AutoModelForCausalLM.from_pretrained(source, experts_implementation="eager")
    aux = bool(getattr(model.config, "output_router_logits", False))
    loads, seen = _counting(model), []
    optimizer, losses = adamw(list(model.parameters())), []
    for step in range(STEPS):
        ids, labels = token_batch(step, rows=ROWS)
        tokens, total = counted_tokens(labels), 0.0
        for lo in range(0, ROWS, ROWS // CHUNKS):
            hi = lo + ROWS // CHUNKS
            out = model(input_ids=ids[lo:hi], output_router_logits=aux)
            logits = {"logits": out.logits, "aux_loss": model.config.router_aux_loss_coef * out.aux_loss} if aux \
                else out.logits
            loss = causal_lm_loss(logits, causal_lm_targets(labels[lo:hi], tokens=tokens, rows=ROWS)) / CHUNKS
            loss.backward()
            total += loss.item()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(total)
        with torch.no_grad():
            for router, load in zip([m for m in model.modules() if hasattr(m, "e_score_correction_bias")], loads,
                                    strict=True):
                router.e_score_correction_bias += torch.sign(load.mean() - load) * speed
        seen.extend(load.clone() for load in loads)
        for load in loads:
            load.zero_()
    return losses, model, torch.stack(seen) if seen else torch.zeros(0)


@pytest.mark.timeout(SPAWN_TIMEOUT_S + 30)
@pytest.mark.parametrize("name", list(RUNS))
def test_training_equals_one_process_transformers(spawned: Any, references: References, name: str) -> None:
    root, results = spawned
    source, _, options = RUNS[name]
    losses, reference, _ = references.of(root / source, options.get("speed", 0.0))
    for result in results:
        got = result[name]["losses"]
        assert max(abs(a - b) / b for a, b in zip(got, losses, strict=True)) <= 1e-9, (got, losses)
    trained, start = _load(root / f"ft-{name}").state_dict(), _load(root / source).state_dict()
    for key, tensor in reference.state_dict().items():
        assert _close(trained[key], tensor), (key, rel(trained[key], tensor))
    moved = [rel(reference.state_dict()[k], v) for k, v in start.items() if ".experts." in k]
    assert min(moved) > 0 and max(moved) > 1e-3, moved  # the steps moved the experts: the comparison is not vacuous


@pytest.mark.timeout(SPAWN_TIMEOUT_S + 30)
@pytest.mark.parametrize("family", FAMILIES)
def test_overlap_on_and_off_are_bit_equal(spawned: Any, family: str) -> None:
    root, results = spawned
    on = f"{family}-aux dualpipev" if family in WITH_AUX else f"{family} dualpipev"
    off = f"{family} dualpipev no-overlap"
    for result in results:
        assert result[on]["overlap"] and not result[off]["overlap"]
        assert result[on]["losses"] == result[off]["losses"]
    want, got = file_tensors(root / f"ft-{on}"), file_tensors(root / f"ft-{off}")
    assert want.keys() == got.keys() and all(torch.equal(want[k], got[k]) for k in want)


@pytest.mark.timeout(SPAWN_TIMEOUT_S + 30)
def test_an_expert_parallel_rank_without_tokens_is_still_exact(spawned: Any, references: References) -> None:
    """Steered away from experts 4..7, DeepSeek-V3 sends no token to expert-parallel rank 1 (which holds them):
    the run above is exact, and the reference shows those experts got none."""
    root, results = spawned
    _, _, seen = references.of(root / "deepseek_v3-steered")
    assert seen[:, 4:].sum() == 0 and seen[:, :4].sum() > 0
    assert [r["deepseek_v3-steered dualpipev"]["experts"] for r in results[:2]] == [[0, 1, 2, 3], [4, 5, 6, 7]]


@pytest.mark.timeout(SPAWN_TIMEOUT_S + 30)
def test_a_checkpoint_saved_at_ep_2_resumes_at_ep_1_on_pp_4(spawned: Any, references: References) -> None:
    root, results = spawned
    losses, reference, _ = references.of(root / "deepseek_v3", SPEED)
    for result in results:
        assert max(abs(a - b) / b for a, b in zip(result["resume"], losses, strict=True)) <= 1e-9
    trained = _load(root / "ft-resume").state_dict()
    for key, tensor in reference.state_dict().items():
        assert _close(trained[key], tensor), (key, rel(trained[key], tensor))
    bias = [k for k in trained if k.endswith("e_score_correction_bias")]
    assert bias and all(trained[k].abs().max() > 0 for k in bias)  # the bias moved, and resumed where it was


@pytest.mark.timeout(SPAWN_TIMEOUT_S + 30)
def test_each_rank_reads_its_own_parts_and_half_the_experts(spawned: Any) -> None:
    """Peak CPU bytes during from_pretrained with ep=2 (measured by the profiler): this rank's parts with its own
    half of the experts, plus at most one tensor in flight and 64 KiB."""
    root, results = spawned
    stored = file_tensors(root / "big")
    experts = {k for k in stored if ".experts." in k}
    size = {k: t.numel() * t.element_size() for k, t in stored.items()}
    for rank, result in enumerate(results):
        peak, own, largest, names = result["memory"]
        held = {int(n.split(".experts.")[1].split(".")[0]) for n in names if n in experts}
        assert held == set(range(4 * (rank % 2), 4 * (rank % 2) + 4)), (rank, held)  # dp index = ep index
        parameters = sum(size[n] for n in set(names) & set(stored))
        assert parameters <= own <= parameters + 64 * 1024, (own, parameters)  # + rotary and expert-load buffers
        assert own <= peak <= own + largest + 64 * 1024, (rank, peak, own, largest)
        assert own < 0.4 * sum(size.values()), (own, sum(size.values()))


def test_bad_checkpoints_and_layouts_are_named_before_training(tmp_path: Path,
                                                               capsys: pytest.CaptureFixture[str]) -> None:
    """An MoE family not supported, an expert's tensor missing, num_experts that ep does not divide: one clear error
    from the API, and from the command line exit 2 with one line before any process starts, nothing written."""
    transformers.logging.set_verbosity_error()
    model = tiny_moe("qwen3_moe", layers=2)
    save_published(model, tmp_path / "missing")
    state = file_tensors(tmp_path / "missing")
    del state["model.layers.1.mlp.experts.3.up_proj.weight"]
    save_file(state, str(tmp_path / "missing" / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"1 tensors missing \(model.layers.1.mlp.experts.3.up_proj.weight\)"):
        PretrainedModel.open(tmp_path / "missing")
    save_published(tiny_moe("qwen3_moe", layers=2, num_experts=3), tmp_path / "three")
    with pytest.raises(ValueError, match="num_experts=3 is not divisible by the expert-parallel size ep=2"):
        PretrainedModel.open(tmp_path / "three").parts(2, experts=(0, 2))
    save_published(model, tmp_path / "olmoe")
    set_config(tmp_path / "olmoe", model_type="olmoe")
    with pytest.raises(ValueError, match="model_type 'olmoe' is not supported; supported: deepseek_v3, gpt2"):
        PretrainedModel.open(tmp_path / "olmoe")
    save_published(model, tmp_path / "fp8")
    set_config(tmp_path / "fp8", quantization_config={"quant_method": "fp8", "weight_block_size": [128, 128]})
    with pytest.raises(ValueError, match="quantized weights .quantization_config, quant_method 'fp8'. are not"):
        PretrainedModel.open(tmp_path / "fp8")
    text = "tiny text " * 50
    (tmp_path / "data.txt").write_text(text)
    capsys.readouterr()  # what transformers printed while saving
    for source in ("missing", "three"):
        char_tokenizer(text).save_pretrained(tmp_path / source)
    wanted = {"missing": "model.layers.1.mlp.experts.3.up_proj.weight", "three": "num_experts=3 is not divisible",
              "olmoe": "model_type 'olmoe' is not supported"}
    for source, message in wanted.items():
        code = main(["train", "--task", "hf", "--task-option", f"model={tmp_path / source}", "--task-option",
                     f"data={tmp_path / 'data.txt'}", "--ranks", "2",
                     "--dp", "2", "--ep", "2", "--schedule", "1f1b", "--save-pretrained", str(tmp_path / "out")])
        err = capsys.readouterr().err
        assert code == 2 and message in err and len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "out").exists()
