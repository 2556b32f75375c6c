"""The planner: candidates ranked under the cap, reasons for rejections, ZeRO, the data-parallel reduction
and the lightest compression that hides it, and one-line errors."""

from __future__ import annotations

import json
import math
from dataclasses import replace

import pytest

from duplexpipe.errors import PlanError
from duplexpipe.planner.candidates import microbatch_counts
from duplexpipe.planner.dp_comm import Link
from duplexpipe.planner.memory import MemoryConfig, StageBytes, rank_memory
from duplexpipe.planner.plan import PlanConfig, plan, static_bytes
from duplexpipe.planner.profile import PartProfile, Profile, RuntimeOverhead
from duplexpipe.schedules import registry
from duplexpipe.schedules.shard import add_unshard_reshard, grad_reductions
from duplexpipe.schedules.simulate import CostModel, simulate
from duplexpipe.sizes import format_bytes
from duplexpipe.train.pipeline_config import DataParallelConfig

MIB = 2**20


def profile(parts: int = 4) -> Profile:
    """Identical parts measured at microbatch 4: F = I = W = 1 ms, 1 MiB kept, 8 MiB of parameters."""
    return Profile(tuple(PartProfile(1e-3, 1e-3, 1e-3, MIB, 8 * MIB, 64 * 1024, 64 * 1024)
                         for _ in range(parts)), 4)


def config(**changes: object) -> PlanConfig:
    base = {"ranks": 2, "batch": 16, "memory": 200 * MIB}
    base.update(changes)
    return PlanConfig(**base)  # type: ignore[arg-type]


def test_feasible_rows_come_first_by_step_time_and_fit_the_cap() -> None:
    result = plan(profile(), config(memory=80 * MIB))
    fits = [r for r in result.rows if r.feasible]
    assert result.best is result.rows[0] and tuple(fits) == result.rows[:len(fits)]
    assert [r.step_s for r in fits] == sorted(r.step_s for r in fits)
    assert all(r.peak_bytes <= 80 * MIB for r in fits)
    assert all(r.rejected for r in result.rows[len(fits):])
    names = {r.schedule for r in result.rows}
    assert {"gpipe", "1f1b", "zb-h1", "zb-h2", "zbv", "dualpipe", "dualpipev", "auto(linear)", "auto(v)",
            "interleaved-1f1b(chunks=2)", "interleaved-1f1b(chunks=4)"} <= names
    assert {r.microbatches for r in result.rows} == {2, 4, 8, 16}
    assert all(len(r.memory) == 2 for r in fits)
    assert result.schedule is not None and result.schedule.num_microbatches == result.best.microbatches
    assert result.best.schedule.startswith(result.schedule.name)


def test_rejections_say_why() -> None:
    result = plan(profile(), config(memory=80 * MIB))
    reasons = {(r.schedule, r.microbatches): r.rejected for r in result.rows}
    assert "num_microbatches >= 2 * num_ranks" in reasons[("dualpipe", 2)]
    assert "interleaved" in next(k for k, v in reasons.items() if "profile has 4 parts" in v)[0]
    over = [r for r in result.rows if r.rejected.startswith("peak")]
    assert over and all(r.peak_bytes > 80 * MIB and "> cap 80 MiB" in r.rejected for r in over)
    odd = plan(profile(), config(microbatches=(3, 4)))
    assert "batch/D = 16 does not split into 3 microbatches" in {r.rejected for r in odd.rows}


def test_a_cap_below_every_plan_names_the_smallest_feasible_cap_which_then_works() -> None:
    with pytest.raises(PlanError, match="no plan fits 20 MiB per rank; the smallest feasible cap is") as info:
        plan(profile(), config(memory=20 * MIB))
    cap = info.value.smallest_cap
    assert cap is not None and cap > 20 * MIB
    result = plan(profile(), config(memory=cap))
    assert result.best.peak_bytes <= cap


@pytest.mark.parametrize(("changes", "needle"), [
    ({"ranks": 5}, "the profile has 4 parts, but 5 ranks need at least 5"),
    ({"batch": 15, "dp": 2}, "batch 15 does not split over dp=2 replicas"),
    ({"schedules": ("zb-h9",)}, "unknown schedule 'zb-h9'"),
    ({"zero_stages": (7,)}, "unknown ZeRO stage 7"),
    ({"compressions": ("gzip",)}, "unknown compression 'gzip'"),
    ({"memory": 0}, "plan needs memory as an integer >= 1, got 0"),
    ({"cores": 0}, "plan needs cores as a number > 0 or None"),
    ({"cores": "2"}, "plan needs cores as a number > 0"),
])
def test_bad_settings(changes: dict[str, object], needle: str) -> None:
    with pytest.raises(ValueError, match=needle.replace("(", r"\(")):
        plan(profile(), config(**changes))


def test_zero_stages_peaks_with_data_parallelism() -> None:
    result = plan(profile(), config(dp=2, schedules=("1f1b",), microbatches=(4,), zero_stages=(0, 1, 2)))
    peak = {r.zero: r.peak_bytes for r in result.rows}
    # per rank 16 MiB of parameters: ZeRO-1 halves 32 MiB of AdamW states; ZeRO-2 (FSDP2) holds the gradients whole
    # until the step's reduce-scatter, as ZeRO-1 does, and its 1/D parameter shards (8 MiB) beside the parameters
    assert peak[0] - peak[1] == pytest.approx(16 * MIB) and peak[2] - peak[1] == pytest.approx(8 * MIB)


def test_the_lightest_compression_that_hides_the_reduction_is_chosen_and_advised() -> None:
    # zb-h1, M=4 of batch 8 per replica: each rank's part has 16 MiB of gradients and its last W takes
    # 1 ms. An all-reduce over 2 replicas moves 16 MiB: at 16 MiB / 1.5 ms it shows 0.5 ms, bf16 hides.
    link = Link(bandwidth=16 * MIB / 1.5e-3)
    plain = plan(profile(), config(dp=2, schedules=("zb-h1",), microbatches=(4,), zero_stages=(0,), dp_link=link,
                                   compressions=("none",)))
    assert plain.best.compression == "none"
    assert plain.best.dp_exposed_s == pytest.approx(0.5e-3)
    assert plain.best.step_s == pytest.approx(plain.best.makespan_s + 0.5e-3)
    assert plain.advice.endswith("with ZeRO 0: bf16 (2x fewer bytes) (not among the allowed)")
    default = plan(profile(), config(dp=2, schedules=("zb-h1",), microbatches=(4,), zero_stages=(0,), dp_link=link))
    assert default.best.compression == "bf16", "every available method is a candidate by default"
    allowed = plan(profile(), config(dp=2, schedules=("zb-h1",), microbatches=(4,), zero_stages=(0,), dp_link=link,
                                     compressions=("none", "bf16", "int8")))
    assert allowed.best.compression == "bf16" and allowed.best.dp_exposed_s == pytest.approx(0.0, abs=1e-12)
    fast = plan(profile(), config(dp=2, schedules=("zb-h1",), microbatches=(4,), dp_link=Link(1e15)))
    assert "without compression" in fast.advice
    assert plan(profile(), config(schedules=("zb-h1",))).advice == ""


def test_only_pairs_the_trainer_accepts_are_planned() -> None:
    from duplexpipe import PipelineConfig
    from duplexpipe.planner.dp_comm import compression

    slow = Link(bandwidth=16 * MIB / 100e-3)  # nothing hides: the heaviest method the trainer runs wins
    result = plan(profile(), config(dp=2, schedules=("zb-h1", "1f1b"), microbatches=(4,), dp_link=slow))
    fits = [r for r in result.rows if r.feasible]
    assert {r.zero for r in fits} == {0, 1, 2}
    for row in fits:  # what the planner chose, the trainer takes
        PipelineConfig(data_parallel=DataParallelConfig(zero_stage=row.zero,
                                                        grad_compression=compression(row.compression).options))
    assert {r.compression for r in fits if r.zero} <= {"none", "bf16", "fp16", "int8"}
    assert {r.compression for r in fits if r.zero == 0} == {"dgc"}
    refused = plan(profile(), config(dp=2, schedules=("1f1b",), microbatches=(4,), zero_stages=(0, 1),
                                     compressions=("powersgd",)))
    assert [r.zero for r in refused.rows if r.feasible] == [0]
    why = next(r.rejected for r in refused.rows if r.zero == 1)
    assert "the trainer refuses ZeRO 1 with every allowed compression (powersgd: gradient compression 'powersgd' " \
           "cannot be combined with ZeRO" in why
    mine = plan(profile(), config(dp=2, schedules=("1f1b",), microbatches=(4,), zero_stages=(0,), dp_link=slow,
                                  refusal=lambda zero, options: "no" if options.method == "dgc" else None))
    assert mine.best.compression == "powersgd(rank=1)", "a caller's rule (the Pipeline's whole config) is asked"


def test_zero_stages_are_one_plan_without_data_parallelism() -> None:
    every = plan(profile(), config(zero_stages=(0, 1, 2), schedules=("1f1b",)))
    assert {r.zero for r in every.rows} == {0}
    assert every.table() == plan(profile(), config(zero_stages=(0,), schedules=("1f1b",))).table()
    assert {r.zero for r in plan(profile(), config(zero_stages=(2, 1), schedules=("1f1b",))).rows} == {1}
    assert {r.zero for r in plan(profile(), config(dp=2, schedules=("1f1b",))).rows} == {0, 1, 2}


def test_at_equal_step_time_the_lower_zero_stage_wins() -> None:
    result = plan(profile(), config(dp=2, schedules=("1f1b",), microbatches=(4,)))
    assert result.best.zero == 0 and result.best.step_s == max(r.step_s for r in result.rows)


def test_dualpipe_pays_for_its_mirror_sum_after_the_last_pass() -> None:
    link = Link(bandwidth=8 * MIB / 1e-3)  # one part's gradients in 1 ms
    result = plan(profile(), config(schedules=("dualpipe",), microbatches=(4,), p2p_link=link))
    row = result.best
    assert row.dp_exposed_s == pytest.approx(2e-3)  # each rank exchanges its mirrored part: 16 MiB


def test_auto_candidates_fit_their_byte_budget() -> None:
    result = plan(profile(8), config(ranks=4, batch=32, memory=90 * MIB, schedules=("auto", "zb-h1", "zbv")))
    autos = [r for r in result.rows if r.schedule.startswith("auto") and r.feasible]
    assert {r.schedule for r in autos} == {"auto(linear)", "auto(v)"}
    assert all(r.peak_bytes <= 90 * MIB for r in autos)
    for m in {r.microbatches for r in autos}:
        mine = {r.schedule: r.step_s for r in result.rows if r.microbatches == m and r.feasible}
        if "zb-h1" in mine and "auto(linear)" in mine:
            assert mine["auto(linear)"] <= mine["zb-h1"] + 1e-12


def test_json_and_table() -> None:
    result = plan(profile(), config(memory=80 * MIB))
    data = json.loads(json.dumps(result.to_dict()))
    assert data["best"]["schedule"] == result.best.schedule and len(data["candidates"]) == len(result.rows)
    assert all(c["step_s"] is None or math.isfinite(c["step_s"]) for c in data["candidates"])
    text = result.table()
    assert text.splitlines()[0].split()[:4] == ["schedule", "M", "ZeRO", "compression"]
    assert "why rejected" in text and len(result.table(3).splitlines()) == 4


def test_microbatch_counts() -> None:
    assert microbatch_counts(config()) == [2, 4, 8, 16]
    assert microbatch_counts(config(ranks=4, batch=96, dp=2)) == [4, 6, 8, 12, 16, 24]
    assert microbatch_counts(config(ranks=8, batch=6)) == [1, 2, 3, 6]
    assert microbatch_counts(config(microbatches=(5,))) == [5]


def test_when_nothing_hides_a_heavier_compression_must_buy_real_time() -> None:
    everything = ("none", "bf16", "int8", "powersgd", "powersgd(rank=1)", "dgc")
    slow = Link(bandwidth=16 * MIB / 100e-3)  # all-reduce 100 ms; dgc (50x) 2 ms against a 1 ms last W
    row = plan(profile(), config(dp=2, schedules=("zb-h1",), microbatches=(4,), dp_link=slow,
                                 compressions=everything)).best
    assert row.compression == "dgc" and row.dp_exposed_s == pytest.approx(1e-3)
    mirrored = plan(profile(), config(dp=2, schedules=("dualpipe",), microbatches=(4,), dp_link=Link(1e12),
                                      compressions=everything))
    # DualPipe reduces after its mirror sum: nothing hides, and 20x less of a tiny reduction is not worth it
    assert mirrored.best.compression == "none" and "after its mirror sum" in mirrored.advice


def one(prof: Profile, **changes: object) -> float:
    """The predicted step of 1F1B at M=4 (ranks 2, batch 16: microbatches of 4 rows, the profiled size)."""
    return plan(prof, config(schedules=("1f1b",), microbatches=(4,), zero_stages=(0,), **changes)).best.step_s


def test_shared_cores_serialize_the_ranks_and_enough_cores_change_nothing() -> None:
    alone = one(profile())
    assert one(profile(), cores=2) == alone == one(profile(), cores=8)
    # one core: every compute runs back to back; 2 groups of 2 parts, 4 microbatches of F + I + W = 3 ms
    assert one(profile(), cores=1) == pytest.approx(2 * 2 * 4 * 3e-3)
    assert alone < one(profile(), cores=1)


def test_measured_runtime_overhead_and_affine_times_enter_the_prediction() -> None:
    base = profile()
    step = RuntimeOverhead(0.0, 0.0, 5e-3)
    assert one(replace(base, overhead=step)) == pytest.approx(one(base) + 5e-3)  # per-step work at the end
    per_action = one(replace(base, overhead=RuntimeOverhead(1e-4, 0.0, 0.0)))
    per_message = one(replace(base, overhead=RuntimeOverhead(0.0, 1e-4, 0.0)))
    assert per_action > one(base) and per_message > one(base)
    # the compute scale: on one core every compute runs back to back, so the step is alpha x all compute
    scaled = replace(base, overhead=RuntimeOverhead(0.0, 0.0, 0.0, compute_scale=1.5))
    assert one(scaled, cores=1) == pytest.approx(1.5 * one(base, cores=1))
    # fixed parts: at the profiled size nothing changes; at half the rows the fixed part does not halve
    fixed = Profile(tuple(replace(p, forward_fixed_s=5e-4, backward_input_fixed_s=5e-4, backward_weight_fixed_s=5e-4)
                          for p in base.parts), 4)
    assert one(fixed) == pytest.approx(one(base))
    half = {"batch": 8}
    assert one(fixed, **half) > one(base, **half)
    assert one(fixed.basic(), **half) == pytest.approx(one(base, **half))


def test_parts_are_grouped_as_profiled_whatever_the_candidate_microbatch() -> None:
    # at the profiled 4 rows the F+B times are 1, 1, 1, 1.5 (x3): two groups of two parts. At 1 row the
    # last part's time is all fixed and the others shrink 4x, so balancing there would give 3 + 1; the
    # planner keeps the profiled grouping, the one `pipeline.autoplan` rebuilds from the profile's times.
    def part(t: float, fixed: float, params: int) -> PartProfile:
        return PartProfile(t, t, t, MIB, params, 1024, 1024, fixed, fixed, fixed)
    prof = Profile((part(1e-3, 0.0, 1), part(1e-3, 0.0, 2), part(1e-3, 0.0, 4), part(1.5e-3, 1.5e-3, 8)), 4)
    assert prof.group_sizes(2) == [2, 2] and prof.at_microbatch(1).group_sizes(2) == [3, 1]
    row = plan(prof, config(batch=4, schedules=("1f1b",), microbatches=(4,), zero_stages=(0,))).best
    assert [m.params for m in row.memory] == [3, 12]
    with pytest.raises(ValueError, match=r"group sizes \[3, 2\] do not split 4 parts into 2 groups"):
        prof.grouped(2, [3, 2])


def test_a_measured_fused_backward_prices_b_actions_only() -> None:
    fused = Profile(tuple(replace(p, backward_fused_s=1.5e-3) for p in profile().parts), 4)  # I + W = 2 ms
    assert one(fused) < one(profile())  # 1F1B runs full B actions
    zb = {"schedules": ("zb-h1",), "microbatches": (4,), "zero_stages": (0,)}
    assert plan(fused, config(**zb)).best.step_s == plan(profile(), config(**zb)).best.step_s  # I and W only
    assert one(fused.basic()) == one(profile())


def test_static_bytes_of_a_window_of_one_bound_the_byte_model_of_the_lowered_schedule() -> None:
    """auto's budget (`static_bytes`, no lowered schedule yet) with a window of one: one stage unsharded and one
    stage's gradient whole beside the 1/D shards, as the byte model finds over the lowered ZBV (`rank_memory`)."""
    p, d = 100, 4
    schedule = registry.build("zbv", 2, 4)
    sizes = StageBytes((0,) * 4, (p,) * 4, (0,) * 4, (0,) * 4)
    cfg = MemoryConfig(zero_stage=3, dp=d)
    optimizer = 2 * 2 * p / d
    assert static_bytes(schedule, sizes, 0, cfg) == 2 * p / d + 2 * p + 2 * p + optimizer
    assert static_bytes(schedule, sizes, 0, cfg, 1) == 2 * p / d + p + (p + 2 * p / d) + optimizer
    lowered = add_unshard_reshard(schedule, 1)
    modelled = rank_memory(lowered, simulate(lowered, CostModel()), sizes, cfg)[0]
    assert modelled.params + modelled.gradients + modelled.optimizer == static_bytes(schedule, sizes, 0, cfg, 1)


def test_zero3_with_a_window_of_one_fits_where_zero2_does_not_and_the_plan_says_so() -> None:
    """Parameter-heavy parts at P=2 x D=4 on ZBV (two stages per rank): ZeRO-2 keeps both stages' parameters whole;
    ZeRO-3 keeps 1/D of them at rest and, with a window of one stage, one stage whole at a time."""
    heavy = Profile(tuple(PartProfile(1e-3, 1e-3, 1e-3, MIB, 64 * MIB, 64 * 1024, 64 * 1024) for _ in range(4)), 4)
    base = config(dp=4, batch=32, schedules=("zbv",), microbatches=(4,), dp_link=Link(1e9),
                  zero_stages=(2, 3), checkpointing=(False,))
    roomy = plan(heavy, replace(base, memory=400 * MIB))
    assert roomy.best.zero == 2 and {r.zero for r in roomy.rows} == {2}, "ZeRO-3 is a lever: tried where 2 is over"
    assert roomy.decided.startswith("time: zbv M=4 ZeRO 2 is the fastest candidate and fits")
    zero2 = roomy.best.peak_bytes
    cap = int(zero2) - 8 * MIB
    result = plan(heavy, replace(base, memory=cap))
    best = result.best
    assert (best.zero, best.window) == (3, 1) and best.peak_bytes <= cap
    rows = {r.zero_label: r for r in result.rows}
    assert set(rows) == {"2", "3/all", "3/w1"} and rows["2"].over_cap and rows["3/all"].over_cap
    # ZeRO-3's parameters: 1/D of the rank's two stages at rest, one stage (window 1) or both (all) unsharded
    for label, resident in (("3/w1", 64 * MIB), ("3/all", 128 * MIB)):
        assert rows[label].memory[0].params == pytest.approx(128 * MIB / 4 + resident)
    assert rows["2"].memory[0].params == 128 * MIB + 128 * MIB / 4  # FSDP2 keeps the shards beside
    # gradients: a window of one reduces after each episode (one stage whole beside both 1/D shards); all: both whole
    assert rows["3/w1"].memory[0].gradients == pytest.approx(64 * MIB + 128 * MIB / 4)
    assert rows["3/all"].memory[0].gradients == rows["2"].memory[0].gradients == 128 * MIB
    assert best.step_s > rows["3/all"].step_s, "a window of one gathers more often"
    assert result.decided.startswith("memory: zbv M=4 ZeRO 2 needs ") and f"> {format_bytes(cap)}" in result.decided
    assert "zbv M=4 ZeRO 3/w1 fits at" in result.decided and "% step" in result.decided
    assert "window 1" in result.advice and "all-gathers" in result.advice
    lowered = add_unshard_reshard(registry.build("zbv", 2, 4), 1)  # windowed gradients: one per episode with grads
    most = max(sum(grad_reductions(lowered)[s] for s in lowered.stages_of_rank(r)) for r in range(2))
    assert most > 2 and f"reduce-scatters (at most {most})" in result.advice
    assert result.to_dict()["best"]["reshard_window"] == 1 and result.to_dict()["decided"] == result.decided
    with pytest.raises(PlanError, match=r"smallest feasible cap is .*ZeRO 3/w1") as info:
        plan(heavy, replace(base, memory=int(best.peak_bytes) - MIB))
    assert info.value.smallest_cap == math.ceil(best.peak_bytes)


def test_checkpointing_fits_where_the_plain_plan_does_not_and_costs_a_forward_per_microbatch() -> None:
    """Activation-heavy parts (32 MiB kept, 1 MiB messages): checkpointed, a part keeps its inputs only."""
    heavy = Profile(tuple(PartProfile(1e-3, 1e-3, 1e-3, 32 * MIB, MIB, MIB, MIB) for _ in range(4)), 4)
    base = config(schedules=("1f1b",), microbatches=(8,))
    plain = plan(heavy, replace(base, memory=400 * MIB)).best
    cap = int(plain.peak_bytes) - 16 * MIB
    assert plain.checkpointing == "off"
    result = plan(heavy, replace(base, memory=cap))
    best = result.best
    assert best.checkpointing == "full" and best.peak_bytes <= cap
    # the saved inputs, plus one microbatch's recompute held through its backward (a stage: 2 parts of 16 MiB at
    # microbatch 2)
    assert best.memory[0].activations < plain.memory[0].activations / 8 + 32 * MIB
    # one more forward (1 ms per part at microbatch 4: 0.5 ms at 2, 2 parts per stage) in each of the 8 backward
    # passes of a rank
    assert best.step_s - plain.step_s == pytest.approx(8 * 1e-3, rel=0.3)
    assert result.decided.startswith(f"memory: 1f1b M=8 ZeRO 0 needs {format_bytes(plain.peak_bytes)} > "
                                     f"{format_bytes(cap)}; 1f1b M=8 ZeRO 0, checkpointed fits at")
    assert "full" in result.table().splitlines()[1]
    with pytest.raises(PlanError, match="the smallest feasible cap is .*1f1b, M=8, ZeRO 0, P x D x T"):
        plan(heavy, replace(base, memory=cap, checkpointing=(False,)))


def selective_heavy(measured: bool = True) -> Profile:
    """Activation-heavy parts (32 MiB kept, 1 MiB messages) that keep 12 MiB under selective checkpointing and take
    0.2 ms longer in I recomputing the rest (F is 1 ms: full checkpointing costs 5x the time)."""
    sel = {"selective_activation_bytes": 12 * MIB, "selective_recompute_s": 2e-4} if measured else {}
    return Profile(tuple(PartProfile(1e-3, 1e-3, 1e-3, 32 * MIB, MIB, MIB, MIB, **sel)  # type: ignore[arg-type]
                         for _ in range(4)), 4)


def test_selective_checkpointing_is_chosen_where_only_it_fits_and_says_why() -> None:
    heavy, base = selective_heavy(), config(schedules=("1f1b",), microbatches=(8,), memory=2**40)
    alone = {p: plan(heavy, replace(base, checkpointing=(p,))).best for p in ("off", "selective", "full")}
    assert alone["full"].peak_bytes < alone["selective"].peak_bytes < alone["off"].peak_bytes
    # one recompute per backward pass (0.2 ms per part at microbatch 4: 0.1 ms at 2, 2 parts per stage), on 1F1B's
    # critical path M + P - 1 = 9 of them
    assert alone["selective"].step_s - alone["off"].step_s == pytest.approx(9 * 2e-4, rel=1e-6)
    assert alone["selective"].step_s < alone["full"].step_s
    cap = int(alone["selective"].peak_bytes)
    result = plan(heavy, replace(base, memory=cap))
    best = result.best
    assert best.checkpointing == "selective" and best.activation_checkpointing == "selective"
    assert best.peak_bytes == alone["selective"].peak_bytes and best.step_s == alone["selective"].step_s
    assert not [r for r in result.rows if r.checkpointing == "full"], "full is tried only where selective is over"
    assert result.decided.startswith(f"memory: 1f1b M=8 ZeRO 0 needs {format_bytes(alone['off'].peak_bytes)} > ")
    assert result.decided.endswith(f"; checkpointing selective (off needs {format_bytes(alone['off'].peak_bytes)}, "
                                   "full not needed); activation offload not planned: no host-copy bandwidth known")
    assert "1f1b M=8 ZeRO 0, selectively checkpointed fits at" in result.decided
    assert result.to_dict()["best"]["activation_checkpointing"] == "selective"
    assert "selective" in result.table().splitlines()[1]


def test_full_checkpointing_is_chosen_only_where_selective_does_not_fit() -> None:
    heavy, base = selective_heavy(), config(schedules=("1f1b",), microbatches=(8,), memory=2**40)
    sel = plan(heavy, replace(base, checkpointing=("selective",))).best
    result = plan(heavy, replace(base, memory=int(sel.peak_bytes) - 1))
    assert result.best.checkpointing == "full" and result.best.activation_checkpointing is True
    assert result.decided.endswith(f"; checkpointing full (off needs "
                                   f"{format_bytes(plan(heavy, replace(base, checkpointing=(False,))).best.peak_bytes)}"
                                   f", selective needs {format_bytes(sel.peak_bytes)}); activation offload not "
                                   "planned: no host-copy bandwidth known")
    # a profile without selective figures never plans selective, and says so
    unmeasured = plan(selective_heavy(measured=False), replace(base, memory=int(sel.peak_bytes)))
    assert unmeasured.best.checkpointing == "full"
    assert "selective not measured by the profile" in unmeasured.decided
    assert {r.checkpointing for r in unmeasured.rows} == {"off", "full"}


def test_checkpointing_accepts_true_and_false_and_refuses_other_values() -> None:
    heavy, base = selective_heavy(), config(schedules=("1f1b",), microbatches=(8,), memory=2**40)
    assert plan(heavy, replace(base, checkpointing=(True,))).best.checkpointing == "full"
    assert plan(heavy, replace(base, checkpointing=(False,))).best.checkpointing == "off"
    with pytest.raises(PlanError, match="checkpointing policies among True/False, 'off', 'selective', 'full'; got "
                                        "'partial'"):
        plan(heavy, replace(base, checkpointing=("partial",)))
    with pytest.raises(PlanError, match="allows only selective checkpointing, but the profile has no"):
        plan(selective_heavy(measured=False), replace(base, checkpointing=("selective",)))
