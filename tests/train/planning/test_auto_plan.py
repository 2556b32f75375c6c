"""schedule="auto": rank 0's profile on every rank, the planner's winner built and trained, bad limits refused.

One launch of 2 gloo processes runs every case. Profiling time comes from a scripted timer (no
wall-clock dependence), and the two ranks get different timers: only rank 0's may decide.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import replace
from typing import Any

import pytest
import torch
import torch.distributed as dist
from _clocks import ScriptedClock
from _train_helpers import WIDTH, Reference, adam, batch, make_parts, max_rel_diff, mse
from torch import nn

from duplexpipe.dp_options.compression import (
    AdaptiveOptions,
    Bf16Options,
    DGCOptions,
    Int8Options,
    NoCompression,
    PowerSGDOptions,
)
from duplexpipe.parallel.mesh import ParallelGroups
from duplexpipe.planner.dp_comm import Link
from duplexpipe.planner.plan import PlanConfig, plan
from duplexpipe.planner.runtime_work import OverheadSample
from duplexpipe.sizes import memory_bytes
from duplexpipe.train.part_chain import PartChain
from duplexpipe.train.pipeline_config import AUTO, AUTO_PLAN_KEYS, DataParallelConfig, with_defaults
from duplexpipe.train.planning import plan_pipeline
from duplexpipe.train.planning.auto import PlanSetup, _plan_config, choose, probe_optimizer, trainer_refusal
from duplexpipe.train.planning.calibration import fit_in_pipeline
from duplexpipe.train.planning.choice import RunPlan
from duplexpipe.train.planning.measure_cache import parts_digest
from duplexpipe.train.trainer import Pipeline, PipelineConfig

WORLD = 2
UNIFORM = [(1e-3, 1e-3, 1e-3)] * 4
HEAVY_LAST = [(1e-3, 1e-3, 1e-3)] * 3 + [(6e-3, 6e-3, 6e-3)]
CANDIDATES = {"schedules": ("1f1b", "zb-h1", "zbv"), "repeats": 1, "warmup": 0, "fit_rows": 0, "fused": False,
              "evict_bytes": 0, "calibrate": False}  # the scripted timer times F, I and W once per part


class Records(logging.Handler):
    """Keeps the messages logged to "duplexpipe.plan"."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def _pipe(costs_rank0: list[tuple[float, float, float]], costs_other: list[tuple[float, float, float]],
          limit: int | str | None = None) -> Pipeline:
    clock = ScriptedClock(costs_rank0 if dist.get_rank() == 0 else costs_other)
    config = PipelineConfig(schedule=AUTO, num_microbatches=4, memory_limit=limit,
                            schedule_options={**CANDIDATES, "timer": clock})
    x, y = batch(0)
    parts = make_parts(4)
    return Pipeline(parts, mse, adam, plan_pipeline(parts, mse, adam, config, sample_input=x, sample_targets=y))


def _train(pipe: Pipeline, steps: int = 4) -> dict[str, Any]:
    ref = Reference(make_parts(4))
    losses, ref_losses = [], []
    for step in range(steps):
        x, y = batch(step)
        ref_losses += ref.step([(x, y)])
        losses.append(pipe.step(x, y))
    # the reference's parts merged like the pipeline's: compare each stage with its run of parts
    merged = nn.ModuleList(pipe.auto.merged_parts(ref.parts)) if pipe.auto is not None else None
    assert merged is not None
    worst = 0.0
    for stage, module in pipe.stage_modules.items():
        mine = dict(module.named_parameters())
        theirs = dict(merged[pipe.schedule.stages[stage].group].named_parameters())
        worst = max(worst, max((mine[k] - theirs[k]).abs().max().item() for k in theirs))
    return {"loss_rel": max_rel_diff(losses, ref_losses), "param": worst, "steps": len(losses)}


def _case(fn: Any) -> dict[str, Any]:
    try:
        return {"ok": fn()}
    except ValueError as exc:
        return {"error": str(exc)}


def _agree() -> dict[str, Any]:
    handler = Records()
    logger = logging.getLogger("duplexpipe.plan")
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        pipe = _pipe(UNIFORM, HEAVY_LAST)
    finally:
        logger.removeHandler(handler)
    assert pipe.auto is not None
    return {"schedule": pipe.schedule.name, "groups": list(pipe.auto.groups), "log": handler.messages,
            "table": pipe.auto.result.table(), "profile": pipe.auto.profile.to_dict(),
            "rows": [(r.schedule, r.step_s, r.peak_bytes) for r in pipe.auto.result.rows],
            "train": _train(pipe)}


def _merged() -> dict[str, Any]:
    pipe = _pipe(HEAVY_LAST, UNIFORM)
    assert pipe.auto is not None
    return {"schedule": pipe.schedule.name, "groups": list(pipe.auto.groups),
            "chains": sorted(s for s, m in pipe.stage_modules.items() if isinstance(m, PartChain)),
            "train": _train(pipe)}


def _capped(limit: int) -> dict[str, Any]:
    pipe = _pipe(UNIFORM, HEAVY_LAST, limit)
    assert pipe.auto is not None
    return {"schedule": pipe.schedule.name, "peak": pipe.auto.result.best.peak_bytes, "train": _train(pipe, 2)}


def _worker(rank: int, world: int) -> dict[str, Any]:
    out: dict[str, Any] = {"agree": _agree(), "merged": _merged()}
    rows = {name: peak for name, _, peak in out["agree"]["rows"]}
    out["rows"] = rows
    limit = int(rows["zb-h1"]) + 1  # below zbv's peak (checked by the test)
    out["capped"] = _case(lambda: _capped(limit))
    out["limit"] = limit
    out["too_small"] = _case(lambda: _capped(1))
    out["bad_text"] = _case(lambda: _pipe(UNIFORM, UNIFORM, "lots"))
    out["no_sample"] = _case(lambda: plan_pipeline(make_parts(4), mse, adam, PipelineConfig(schedule=AUTO)))
    out["unplanned"] = _case(lambda: Pipeline(make_parts(4), mse, adam, PipelineConfig(schedule=AUTO)))
    return out


def test_every_rank_runs_rank_0s_choice(results: list[dict[str, Any]]) -> None:
    lead, other = (r["agree"] for r in results)
    assert lead["profile"] == other["profile"], "rank 0's profile, broadcast"
    assert [p["forward_s"] for p in lead["profile"]["parts"]] == pytest.approx([1e-3] * 4)
    assert lead["schedule"] == other["schedule"] == "zbv", "uniform costs (rank 0's): ZB-V, not rank 1's pick"
    assert lead["groups"] == [1, 1, 1, 1]


def test_the_choice_is_the_planners_best_for_that_profile(results: list[dict[str, Any]]) -> None:
    from duplexpipe.planner.profile import Profile

    lead = results[0]["agree"]
    expected = plan(Profile.from_dict(lead["profile"]), PlanConfig(ranks=2, batch=16, memory=2**62,
                                                                   schedules=("1f1b", "zb-h1", "zbv"),
                                                                   microbatches=(4,), zero_stages=(0,),
                                                                   compressions=("none",)))
    assert expected.best.schedule == lead["schedule"]
    assert expected.table() == lead["table"]


def test_rank_0_logs_the_choice_and_the_table_once(results: list[dict[str, Any]]) -> None:
    lead, other = (r["agree"] for r in results)
    assert len(lead["log"]) == 1 and other["log"] == []
    message = lead["log"][0]
    assert message.startswith("schedule='auto' chose zbv, M=4, ZeRO 0, gradient compression none")
    assert lead["table"] in message


@pytest.mark.parametrize("case", ["agree", "merged"])
def test_the_winner_trains_like_a_single_process(results: list[dict[str, Any]], case: str) -> None:
    for result in results:
        train = result[case]["train"]
        assert train["loss_rel"] < 1e-5 and train["param"] < 1e-5, train


def test_a_heavy_last_part_merges_the_others(results: list[dict[str, Any]]) -> None:
    lead, other = (r["merged"] for r in results)
    assert lead["schedule"] == other["schedule"] == "zb-h1"
    assert lead["groups"] == [3, 1], "parts 0-2 (3 ms each) against part 3 (18 ms)"
    assert lead["chains"] == [0] and other["chains"] == []


def test_a_limit_below_the_fastest_picks_the_fastest_that_fits(results: list[dict[str, Any]]) -> None:
    lead = results[0]
    assert lead["rows"]["zbv"] > lead["limit"], "the limit rules ZB-V out"
    fits = [(step, name) for name, step, peak in lead["agree"]["rows"] if peak <= lead["limit"]]
    assert min(fits)[1] == "zb-h1"
    for result in results:
        capped = result["capped"]["ok"]
        assert capped["schedule"] == "zb-h1" and capped["peak"] <= result["limit"]
        assert capped["train"]["loss_rel"] < 1e-5


def test_no_feasible_plan_is_a_value_error_on_every_rank(results: list[dict[str, Any]]) -> None:
    messages = [r["too_small"]["error"] for r in results]
    assert all("smallest feasible cap" in m and "no plan fits 1 B per rank" in m for m in messages)
    assert messages[0] == messages[1]
    assert all("bad memory size 'lots'" in r["bad_text"]["error"] for r in results)
    assert all("pass sample_input=" in r["no_sample"]["error"] for r in results)
    assert all("planned before a Pipeline is built" in r["unplanned"]["error"] for r in results)


def test_config_checks() -> None:
    assert memory_bytes("2KiB") == 2048 and memory_bytes(5) == 5 and memory_bytes(None) is None
    for bad in (0, -3, True, 1.5):
        with pytest.raises(ValueError, match="memory_limit"):
            memory_bytes(bad)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="is for schedule='auto'"):
        PipelineConfig(schedule="1f1b", memory_limit="1GiB")
    with pytest.raises(ValueError, match=r"unknown \['chunkz'\]"):
        PipelineConfig(schedule=AUTO, schedule_options={"chunkz": 2})
    with pytest.raises(ValueError, match="unknown"):
        PipelineConfig(schedule=AUTO, schedule_options={"cost": 1})


def test_the_configs_planner_keys_are_the_planners_settings() -> None:
    """PipelineConfig checks schedule_options without importing the planner: its list of the planner's keys is
    PlanConfig's fields less those the Pipeline fills in."""
    given = {"ranks", "batch", "memory", "dp", "refusal", "tp", "sequence_parallel", "reshard_windows",
             "checkpointing"}
    assert set(AUTO_PLAN_KEYS) == {f.name for f in dataclasses.fields(PlanConfig)} - given
    assert len(AUTO_PLAN_KEYS) == len(set(AUTO_PLAN_KEYS))


def test_a_chain_calls_each_part_as_the_runtime_calls_a_stage() -> None:
    class Pair(nn.Module):
        def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            return x, 2 * x

    class Add(nn.Module):
        def forward(self, a: torch.Tensor, b: torch.Tensor) -> dict[str, torch.Tensor]:
            return {"h": a + b}

    class Take(nn.Module):
        def forward(self, h: torch.Tensor) -> torch.Tensor:
            return h + 1

    x = torch.arange(3.0)
    assert torch.equal(PartChain([Pair(), Add(), Take()])(x), 3 * x + 1)


def test_a_set_field_is_fixed_and_cannot_also_be_searched() -> None:
    for field, key, fields in (("num_microbatches", "microbatches", {"num_microbatches": 4}),
                               ("data_parallel.zero_stage", "zero_stages",
                                {"data_parallel": DataParallelConfig(zero_stage=1)}),
                               ("data_parallel.grad_compression", "compressions",
                                {"data_parallel": DataParallelConfig(grad_compression="bf16")})):
        value = 4 if key == "microbatches" else 1 if key == "zero_stages" else "bf16"
        with pytest.raises(ValueError, match=f"PipelineConfig.{field}=.* fixes what schedule_options\\['{key}'\\]"):
            PipelineConfig(schedule=AUTO, schedule_options={key: (value,)}, **fields)  # type: ignore[arg-type]
        PipelineConfig(schedule=AUTO, schedule_options={key: (value,)})  # unset: the key narrows the search
    defaults = with_defaults(PipelineConfig())
    assert defaults.num_microbatches == 4 and defaults.data_parallel.zero_stage == 0
    assert with_defaults(PipelineConfig(num_microbatches=8,
                                        data_parallel=DataParallelConfig(zero_stage=1))).num_microbatches == 8
    with pytest.raises(ValueError, match="num_microbatches must be an int >= 1 or None, got 0"):
        PipelineConfig(num_microbatches=0)


def test_the_planners_space_is_the_unset_fields() -> None:
    setup = PlanSetup(ParallelGroups(None, 0, 2, None, 0, 2), torch.device("cpu"))
    free = _plan_config(PipelineConfig(schedule=AUTO), {"chunks": [2]}, 16, setup, lambda z, o: None)
    assert (free.microbatches, free.zero_stages, free.compressions, free.chunks) == (None, None, None, (2,))
    assert (free.batch, free.dp, free.ranks) == (32, 2, 2)
    fixed = _plan_config(PipelineConfig(schedule=AUTO, num_microbatches=8,
                                        data_parallel=DataParallelConfig(zero_stage=1, grad_compression="int8")),
                         {}, 16, setup, lambda z, o: None)
    assert fixed.microbatches == (8,) and fixed.zero_stages == (1,) and fixed.compressions == (Int8Options(),)


def test_the_trainers_rule_refuses_what_the_trainer_refuses() -> None:
    parts = make_parts(2)
    rule = trainer_refusal(PipelineConfig(schedule=AUTO), probe_optimizer(adam), parts, dp=2)
    assert rule(0, NoCompression()) is None and rule(1, Int8Options()) is None and rule(0, PowerSGDOptions()) is None
    assert "cannot be combined with ZeRO" in (rule(1, PowerSGDOptions()) or "")
    assert "assumes SGD" in (rule(0, DGCOptions()) or ""), "DGC under Adam: the optimizer check"
    sgd = trainer_refusal(PipelineConfig(schedule=AUTO), probe_optimizer(lambda p: torch.optim.SGD(p, lr=0.1)),
                          parts, dp=2)
    assert sgd(0, DGCOptions()) is None
    assert "momentum" in (trainer_refusal(PipelineConfig(schedule=AUTO), probe_optimizer(
        lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9)), parts, dp=2)(0, DGCOptions()) or "")
    clipped = trainer_refusal(PipelineConfig(schedule=AUTO, grad_clip_norm=1.0), None, parts, dp=2)
    assert "grad_clip_norm" in (clipped(0, DGCOptions()) or "")
    shared = nn.Linear(WIDTH, WIDTH)
    tied = [nn.Sequential(shared), nn.Sequential(nn.Tanh(), shared)]
    assert "shared by several model parts" in (trainer_refusal(PipelineConfig(schedule=AUTO), None, tied, 2)(
        1, NoCompression()) or "")
    assert trainer_refusal(PipelineConfig(schedule=AUTO), None, tied, 1)(1, NoCompression()) is None


def test_the_run_plan_says_what_runs() -> None:
    run = RunPlan("interleaved-1f1b(chunks=2)", 8, 1, Int8Options(), 0.0123)
    assert run.summary() == "interleaved-1f1b(chunks=2), M=8, ZeRO 1, gradient compression int8 (predicted step " \
                            "12.3 ms)"
    assert RunPlan("1f1b", 4, 0, PowerSGDOptions(rank=1)).summary() == \
        "1f1b, M=4, ZeRO 0, gradient compression powersgd(rank=1)"


def test_measurements_are_cached_per_parts_and_sample(tmp_path: Any) -> None:
    """In one process (P=2 planned, calibrate=False): the second choice of the same parts and sample reads the
    cache and never the profiling clock; another sample shape measures again."""
    setup = PlanSetup(ParallelGroups(None, 0, 2, None, 0, 1), torch.device("cpu"))
    clocks = []

    def choice(rows: int, costs: list[tuple[float, float, float]]) -> Any:
        clocks.append(ScriptedClock(costs))
        options = {**CANDIDATES, "timer": clocks[-1], "calibration_cache": str(tmp_path)}
        x, y = batch(0, rows)
        return choose(make_parts(4), mse, adam, PipelineConfig(schedule=AUTO, num_microbatches=4,
                                                               schedule_options=options), setup, (x, y))

    first = choice(16, HEAVY_LAST)
    # 4 reads per part and run, 4 parts, one run plain and one under selective checkpointing
    assert first.source.startswith("measured, cached in ") and clocks[0].reads == 32
    again = choice(16, UNIFORM)  # a different clock: were it read, the plan would change
    assert again.source == f"cache {first.source.split('cached in ')[1]}" and clocks[1].reads == 0
    assert again.plan == first.plan and again.profile == first.profile and again.groups == (3, 1)
    other = choice(32, UNIFORM)
    assert other.source.startswith("measured") and clocks[2].reads == 32 and other.groups == (1, 1, 1, 1)
    assert len(list(tmp_path.glob("*.json"))) == 2


def test_parts_digest_sees_structure_not_values() -> None:
    a, b = make_parts(2, seed=0), make_parts(2, seed=1)
    assert parts_digest(a) == parts_digest(b)
    assert parts_digest(a) != parts_digest(make_parts(2, num_blocks=6))
    assert parts_digest(a) != parts_digest([nn.Sequential(nn.Linear(WIDTH, 2 * WIDTH))] + list(a[1:]))


def test_a_searched_choice_is_applied_as_fixed_fields() -> None:
    options = {**CANDIDATES, "timer": ScriptedClock(UNIFORM), "microbatches": (2, 4), "zero_stages": (0, 1),
               "compressions": ("none", "bf16")}
    config = PipelineConfig(schedule=AUTO, schedule_options=options)
    x, y = batch(0)
    chosen = choose(make_parts(4), mse, adam, config, PlanSetup(ParallelGroups(None, 0, 2, None, 0, 2),
                                                                torch.device("cpu")), (x, y))
    ran = chosen.applied(config)
    assert (ran.num_microbatches, ran.data_parallel.zero_stage, ran.data_parallel.grad_compression) == (
        chosen.plan.microbatches, chosen.plan.zero_stage, chosen.plan.grad_compression)
    assert chosen.plan.microbatches in (2, 4) and chosen.plan.zero_stage in (0, 1)
    assert not {"microbatches", "zero_stages", "compressions"} & set(ran.schedule_options)
    assert ran.schedule_options["schedules"] == CANDIDATES["schedules"] and ran.schedule == AUTO


def test_the_in_pipeline_fit_recovers_its_terms_and_distrusts_a_wild_scale() -> None:
    counts = [(8, 8, 0.050), (16, 16, 0.069), (12, 8, 0.059), (8, 16, 0.057), (16, 32, 0.069), (12, 16, 0.066)]
    exact = [OverheadSample(a, m, 1.3 * c + 2e-4 * a + 1e-4 * m + 3e-3, c) for a, m, c in counts]
    fitted = fit_in_pipeline(exact, "exact")
    assert not isinstance(fitted, str)
    assert (fitted.compute_scale, fitted.action_s, fitted.message_s, fitted.step_s) == pytest.approx(
        (1.3, 2e-4, 1e-4, 3e-3), rel=1e-6)
    wild = [OverheadSample(a, m, 1e3 * c, c) for a, m, c in counts]  # CPU time 1000x the profile: disturbed
    held = fit_in_pipeline(wild, "wild")
    assert not isinstance(held, str) and held.compute_scale == 1.0
    assert "compute scale 1e+03 is implausible: the scale held at 1" in held.method
    flat = [OverheadSample(a, m, 0.001 * a + 0.002, c) for a, m, c in counts]  # CPU time ignores the compute
    unscaled = fit_in_pipeline(flat, "flat")
    assert not isinstance(unscaled, str) and unscaled.compute_scale == 1.0 and "the scale held at 1" in unscaled.method
    assert "cannot separate" in str(fit_in_pipeline(exact[:2], "two"))


def test_a_plan_is_public_and_built_for_one_mesh() -> None:
    """plan_pipeline is the public step before construction; a Pipeline refuses a plan made for another mesh before
    it builds anything, and a PipelineConfig of schedule="auto" must be planned first."""
    import duplexpipe

    assert duplexpipe.plan_pipeline is plan_pipeline
    parts = make_parts(2)
    plan = plan_pipeline(parts, mse, adam, PipelineConfig("1f1b", 4))
    assert (plan.sizes, plan.schedule.name, plan.plan.microbatches, plan.auto) == ((1, 1, 1), "1f1b", 4, None)
    with pytest.raises(ValueError, match=r"the plan was made for a mesh of \(pp, dp, tp\) = \(2, 1, 1\), but this one "
                                         r"is \(1, 1, 1\)"):
        Pipeline(parts, mse, adam, dataclasses.replace(plan, sizes=(2, 1, 1)))
    with pytest.raises(ValueError, match="schedule='auto' is planned before a Pipeline is built: plan = "
                                         "duplexpipe.plan_pipeline"):
        Pipeline(parts, mse, adam, PipelineConfig(schedule=AUTO))


def test_the_planners_memory_levers_reach_the_config_that_runs() -> None:
    """Checkpointing and ZeRO-3's window are the planner's to choose where the config leaves them at their
    defaults; what it chose is what the Pipeline is built with."""
    from duplexpipe.planner.profile import PartProfile, Profile
    from duplexpipe.train.planning.choice import AutoChoice

    setup = PlanSetup(ParallelGroups(None, 0, 2, None, 0, 1), torch.device("cpu"))

    def planned(config: PipelineConfig) -> PlanConfig:
        return _plan_config(config, dict(config.schedule_options), 8, setup, lambda zero, options: None)

    free = planned(PipelineConfig(schedule=AUTO))
    assert free.checkpointing == ("off", "selective", "full") and free.reshard_windows == (1, None)
    assert planned(PipelineConfig(schedule=AUTO, activation_checkpointing=True)).checkpointing == ("full",)
    assert planned(PipelineConfig(schedule=AUTO, activation_checkpointing="selective")).checkpointing == ("selective",)
    assert planned(PipelineConfig(schedule=AUTO, activation_checkpointing=[0])).checkpointing == ("off",)
    fixed = planned(PipelineConfig(schedule=AUTO, data_parallel=DataParallelConfig(zero_stage=3, reshard_window=2)))
    assert fixed.zero_stages == (3,) and fixed.reshard_windows == (2,)
    parts = tuple(PartProfile(1e-3, 1e-3, 1e-3, 1024, 1024, 64, 64) for _ in range(4))
    result = plan(Profile(parts, 4), PlanConfig(ranks=2, batch=8, memory=2**30, schedules=("zbv",)))
    assert result.schedule is not None
    run = RunPlan("zbv", 4, 3, NoCompression(), 0.01, reshard_window=1, activation_checkpointing=True)
    choice = AutoChoice(result, Profile(parts, 4), result.schedule, (1, 1, 1, 1), run)
    applied = choice.applied(PipelineConfig(schedule=AUTO))
    assert applied.data_parallel.zero_stage == 3 and applied.data_parallel.reshard_window == 1
    assert applied.activation_checkpointing is True and applied.num_microbatches == 4
    assert run.summary() == "zbv, M=4, ZeRO 3 (reshard window 1), gradient compression none, activation " \
                            "checkpointing (predicted step 10 ms)"
    selective = replace(run, zero_stage=0, reshard_window=None, activation_checkpointing="selective")
    assert AutoChoice(result, Profile(parts, 4), result.schedule, (1, 1, 1, 1), selective).applied(
        PipelineConfig(schedule=AUTO)).activation_checkpointing == "selective"
    assert selective.summary() == "zbv, M=4, ZeRO 0, gradient compression none, selective activation " \
                                  "checkpointing (predicted step 10 ms)"
    offloaded = replace(selective, activation_checkpointing=False, activation_offload=0.5)
    assert AutoChoice(result, Profile(parts, 4), result.schedule, (1, 1, 1, 1), offloaded).applied(
        PipelineConfig(schedule=AUTO)).activation_offload == 0.5
    assert offloaded.summary().endswith("gradient compression none, activation offload 50% (predicted step 10 ms)")
    assert planned(PipelineConfig(schedule=AUTO, activation_offload=True,
                                  schedule_options={"host_link": Link(1e9)})).host_link is None
    assert planned(PipelineConfig(schedule=AUTO, schedule_options={"host_link": Link(1e9)})).host_link == Link(1e9)
    kept = replace(run, zero_stage=2, reshard_window=None, activation_checkpointing=False)
    assert AutoChoice(result, Profile(parts, 4), result.schedule, (1, 1, 1, 1), kept).applied(
        PipelineConfig(schedule=AUTO, activation_checkpointing=[1])).activation_checkpointing == [1]


def test_adaptive_compression_starts_on_the_planners_rung() -> None:
    adaptive = AdaptiveOptions(ladder="none/bf16/int8")
    options = {**CANDIDATES, "timer": ScriptedClock(UNIFORM), "microbatches": (2, 4)}
    config = PipelineConfig(schedule=AUTO, schedule_options=options,
                            data_parallel=DataParallelConfig(grad_compression=adaptive))
    setup = PlanSetup(ParallelGroups(None, 0, 2, None, 0, 2), torch.device("cpu"))
    space = _plan_config(config, {}, 16, setup, lambda z, o: None)
    assert space.compressions == (NoCompression(), Bf16Options(), Int8Options()) and space.zero_stages == (0,)
    x, y = batch(0)
    chosen = choose(make_parts(4), mse, adam, config, setup, (x, y))
    ran = chosen.applied(config).data_parallel.grad_compression
    assert isinstance(ran, AdaptiveOptions) and ran.ladder == adaptive.ladder
    assert ran.gradient_rungs()[ran.start_rung] == chosen.plan.grad_compression
