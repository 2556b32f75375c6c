"""Prediction vs measurement: the planner's step time and peak activation bytes against runs of the GPT example.

One spawn of 4 gloo processes (one thread each) splits the GPT example into 2P = 8 model parts and
profiles them twice on a microbatch of the step's batch (`profile_parts`): on rank 0 alone while the
other ranks wait, and on every rank at once (rank 0's profile is used), which loads the 2 cores as a
pipeline run does. For each candidate (schedule, M) the planner (`schedules.plan.plan`, no memory cap)
predicts the step time and each rank's peak of live activation bytes; the parts are merged as the
planner grouped them (`autoplan.AutoChoice.merged_parts`) and trained as a `Pipeline`, every candidate
round-robin (step i of each, the first one rotating, then step i+1) so all see the same machine load.
Measured: each step's slowest rank (`harness.timed`) and each rank's `StepInfo.peak_saved_bytes`.
The same spawn times the saved-bytes counting itself on the overhead-bound MLP (1F1B, counting on and
off, alternating).

Targets (issue 12): each measured peak within 10% of its prediction, each step time within 25%, and
candidates whose predictions differ by more than 15% measured in the same order.

Usage: python benchmarks/plan_vs_measured.py [--quick] [--out DIR] [--docs DIR|none] [--load-note TEXT]
       python benchmarks/plan_vs_measured.py --replot   (tables, figure and docs again from OUT/plan_vs_measured.json)
"""

from __future__ import annotations

import argparse
import copy
import functools
import itertools
import json
import os
import shlex
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks import harness, models, report  # noqa: E402
from duplexpipe.pipeline import Pipeline, PipelineConfig, profile_parts  # noqa: E402
from duplexpipe.pipeline.autoplan import NO_LIMIT, AutoChoice  # noqa: E402
from duplexpipe.pipeline.split import build_parts, plan_partition  # noqa: E402
from duplexpipe.runtime.saved_bytes import SavedBytes  # noqa: E402
from duplexpipe.schedules.dp_model import Link  # noqa: E402
from duplexpipe.schedules.memory import format_bytes  # noqa: E402
from duplexpipe.schedules.plan import PlanConfig, plan  # noqa: E402
from duplexpipe.schedules.profiles import Profile, balanced_split  # noqa: E402
from duplexpipe.tasks.gpt import gpt_task  # noqa: E402

BEGIN, END = "<!-- bench:plan-vs-measured:begin -->", "<!-- bench:plan-vs-measured:end -->"
TIME_TARGET = 0.25
"""|measured - predicted| / predicted step time, at most."""
BYTES_TARGET = 0.10
"""|measured - predicted| / predicted peak activation bytes, at most."""
ORDER_GAP = 0.15
"""Candidates whose predicted step times differ by more than this fraction must be measured in that order."""
FIGURE = "plan_vs_measured.png"


@dataclass(frozen=True)
class PvMConfig:
    """What one run measures."""

    ranks: int = 4
    """Pipeline ranks (gloo processes)."""
    n_layer: int = 8
    """GPT blocks (2P model parts of one block each, embedding and head in the first and last)."""
    d_model: int = 64
    """GPT width."""
    batch_size: int = 32
    """Sequences per step (64 characters each)."""
    candidates: tuple[tuple[str, int], ...] = (("1f1b", 4), ("1f1b", 8), ("zb-h1", 8), ("interleaved-1f1b", 8),
                                               ("zbv", 16))
    """(schedule, M) pairs planned and run; interleaved-1f1b with 2 chunks."""
    steps: int = 10
    """Measured steps of every candidate."""
    warmup: int = 2
    """Unmeasured steps of every candidate first."""
    profile_repeats: int = 5
    """profile_parts repeats (the fastest is kept)."""
    overhead_steps: int = 30
    """Steps of the counting-overhead check, each with counting on and off."""


def quick_config() -> PvMConfig:
    """A smoke configuration: 2 ranks, a narrow model, 2 candidates, 2 steps."""
    return PvMConfig(ranks=2, n_layer=4, d_model=32, batch_size=8, candidates=(("1f1b", 4), ("zb-h1", 4)),
                     steps=2, warmup=1, profile_repeats=1, overhead_steps=2)


def _adamw(params: list[nn.Parameter]) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=3e-3, weight_decay=0.01)


def _shared(profile: Profile | None) -> Profile:
    """Rank 0's profile on every rank."""
    payload = [profile.to_dict() if profile is not None else None]
    dist.broadcast_object_list(payload, src=0)
    return Profile.from_dict(payload[0])


def _profiles(parts: list[nn.Module], sample: tuple[Any, Any], loss: Any, cfg: PvMConfig) -> dict[str, Profile]:
    """The parts profiled on rank 0 alone, then on every rank at once (rank 0's kept)."""
    def run() -> Profile:
        return profile_parts(copy.deepcopy(parts), sample[0], target=sample[1], loss_fn=loss,
                             repeats=cfg.profile_repeats, warmup=2)
    alone = run() if dist.get_rank() == 0 else None
    dist.barrier()
    alone_shared = _shared(alone)
    loaded = run()
    dist.barrier()
    return {"alone": alone_shared, "loaded": _shared(loaded if dist.get_rank() == 0 else None)}


def _round_trip(nbytes: int, reps: int) -> float:
    """Median seconds of a send from rank 0 to rank 1 and back, of `nbytes` each way (other ranks wait)."""
    buf = torch.zeros(max(1, nbytes // 4))
    samples = []
    for _ in range(reps):
        start = time.perf_counter()
        if dist.get_rank() == 0:
            dist.send(buf, 1)
            dist.recv(buf, 1)
        elif dist.get_rank() == 1:
            dist.recv(buf, 0)
            dist.send(buf, 0)
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)


def _measure_link(nbytes: int, reps: int = 30) -> Link:
    """The stage-to-stage link as the planner models it: latency per message and bandwidth, from
    round trips of 4 bytes and of `nbytes` (rank 0's figures, shared)."""
    dist.barrier()
    small, big = _round_trip(4, reps), _round_trip(nbytes, reps)
    latency = small / 2
    per_byte = max((big - small) / 2 / max(1, nbytes - 4), 1e-15)
    payload = [(latency, 1 / per_byte)]
    dist.broadcast_object_list(payload, src=0)
    return Link(bandwidth=payload[0][1], latency=payload[0][0])


def _candidate(profile: Profile, cfg: PvMConfig, name: str, m: int, link: Link | None = None) -> AutoChoice:
    """The planner's row and schedule for one (schedule, M), with the parts grouped as it grouped them."""
    config = PlanConfig(ranks=cfg.ranks, batch=cfg.batch_size, memory=NO_LIMIT, schedules=(name,),
                        microbatches=(m,), chunks=(2,), compressions=("none",), p2p_link=link or Link())
    result = plan(profile, config)
    assert result.schedule is not None
    counts = balanced_split([p.forward_s + p.backward_s for p in profile.parts], result.schedule.num_groups)
    return AutoChoice(result, profile, result.schedule, tuple(counts))


def _train(pipes: list[Pipeline], task: Any, cfg: PvMConfig) -> tuple[list[list[float]], list[list[int]]]:
    """Round-robin steps; per candidate, the measured steps' seconds (slowest rank) and this rank's peaks."""
    seconds: list[list[float]] = [[] for _ in pipes]
    peaks: list[list[int]] = [[] for _ in pipes]
    for step in range(cfg.warmup + cfg.steps):
        x, y = task.batch(step, cfg.batch_size)
        for k in range(len(pipes)):
            c = (step + k) % len(pipes)
            took, _ = harness.timed(functools.partial(pipes[c].step, x, y))
            info = pipes[c].last
            assert info is not None
            if step >= cfg.warmup:
                seconds[c].append(took)
                peaks[c].append(info.peak_saved_bytes)
    return seconds, peaks


def _overhead(cfg: PvMConfig, ranks: int) -> dict[str, list[float]]:
    """1F1B on the overhead-bound MLP, counting on and off alternately: each step's slowest-rank seconds."""
    spec = models.ModelSpec("mlp", num_layers=8, width=256, batch=64)
    parts = models.build_parts(spec, ranks)
    x, y = models.make_batch(spec)
    pipes = {on: Pipeline(copy.deepcopy(parts), models.loss_fn, _adamw,
                          PipelineConfig(schedule="1f1b", num_microbatches=8, record_timeline=False,
                                         check_inputs_every_step=False, count_saved_bytes=on))
             for on in (True, False)}
    out: dict[str, list[float]] = {"on": [], "off": []}
    for step in range(cfg.overhead_steps + 2):
        for on in ((True, False) if step % 2 else (False, True)):
            took, _ = harness.timed(functools.partial(pipes[on].step, x, y))
            if step >= 2:
                out["on" if on else "off"].append(took)
    return out


def counting_cost(reps: int) -> dict[str, float]:
    """One process: the overhead-bound MLP's forward + backward with and without SavedBytes counting,
    interleaved; the fastest of `reps` each (contention only adds time)."""
    spec = models.ModelSpec("mlp", num_layers=8, width=256, batch=8)  # one microbatch of batch 64, M=8
    (model,) = models.build_parts(spec, 1)
    x = torch.randn(spec.batch, spec.width)
    meter = SavedBytes(model.parameters())
    times: dict[bool, list[float]] = {True: [], False: []}
    for k in range(2 * reps + 4):
        on = bool(k % 2)
        start = time.perf_counter()
        if on:
            meter.start(data=[x])
            with meter.counting():
                out = model(x)
        else:
            out = model(x)
        out.sum().backward()
        if k >= 4:
            times[on].append(time.perf_counter() - start)
    return {"on_s": min(times[True]), "off_s": min(times[False]),
            "ratio": min(times[True]) / min(times[False])}


def _worker(rank: int, world: int, cfg: PvMConfig) -> dict[str, Any]:
    torch.manual_seed(0)
    task = gpt_task(n_layer=cfg.n_layer, d_model=cfg.d_model)
    partition = plan_partition(task.layers, 2 * world, "uniform", embedding=task.embedding, head=task.head)
    parts: list[nn.Module] = list(build_parts(task.layers, partition, embedding=task.embedding, head=task.head))
    x, y = task.batch(0, cfg.batch_size)
    rows = cfg.batch_size // 8
    profiles = _profiles(parts, (x[:rows], y[:rows]), task.loss_fn, cfg)
    message = max(p.output_bytes for p in profiles["loaded"].at_microbatch(cfg.batch_size / 8).parts[:-1])
    link = _measure_link(int(message))
    choices = [_candidate(profiles["loaded"], cfg, name, m, link) for name, m in cfg.candidates]
    no_link = [_candidate(profiles["loaded"], cfg, name, m) for name, m in cfg.candidates]
    alone = [_candidate(profiles["alone"], cfg, name, m, link) for name, m in cfg.candidates]
    pipes = [Pipeline(c.merged_parts(copy.deepcopy(parts)), task.loss_fn, _adamw,
                      PipelineConfig(schedule=c.schedule, grad_clip_norm=1.0, record_timeline=False,
                                     check_inputs_every_step=False, count_saved_bytes=True)) for c in choices]
    seconds, peaks = _train(pipes, task, cfg)
    out: dict[str, Any] = {"seconds": seconds, "peaks": peaks, "overhead": _overhead(cfg, world)}
    dist.barrier()
    if rank == 0:
        out["counting"] = counting_cost(max(3, cfg.overhead_steps))
        out["profiles"] = {k: p.to_dict() for k, p in profiles.items()}
        out["link"] = {"latency_s": link.latency, "bandwidth": link.bandwidth, "message_bytes": message}
        out["plans"] = [{"row": c.result.best.to_dict(), "groups": list(c.groups),
                         "alone_step_s": a.result.best.step_s, "alone_groups": list(a.groups),
                         "no_link_step_s": n.result.best.step_s}
                        for c, a, n in zip(choices, alone, no_link, strict=True)]
    dist.barrier()
    return out


def _rel(measured: float, predicted: float) -> float:
    return (measured - predicted) / predicted if predicted else float("inf")


def summarize(per_rank: list[dict[str, Any]], cfg: PvMConfig) -> list[dict[str, Any]]:
    """One row per candidate: predicted vs measured step time and peak activation bytes (max over ranks)."""
    lead = per_rank[0]
    rows = []
    for c, plan_row in enumerate(lead["plans"]):
        row = plan_row["row"]
        samples = lead["seconds"][c]
        predicted_acts = [m["activations"] for m in row["per_rank"]]
        measured_acts = [max(r["peaks"][c]) for r in per_rank]
        stable = all(len(set(r["peaks"][c])) == 1 for r in per_rank)
        step = harness.summarize(samples)
        rows.append({
            "candidate": f"{row['schedule']}, M={row['microbatches']}", "groups": plan_row["groups"],
            "alone_groups": plan_row["alone_groups"],
            "predicted_s": row["step_s"], "predicted_alone_s": plan_row["alone_step_s"],
            "predicted_no_link_s": plan_row["no_link_step_s"],
            "measured": step.to_dict(), "min_s": min(samples), "max_s": max(samples), "samples": samples,
            "time_err": _rel(step.median, row["step_s"]),
            "time_err_alone": _rel(step.median, plan_row["alone_step_s"]),
            "time_err_no_link": _rel(step.median, plan_row["no_link_step_s"]),
            "predicted_acts": predicted_acts, "measured_acts": measured_acts, "peaks_stable": stable,
            "bytes_err": _rel(max(measured_acts), max(predicted_acts)),
            "bytes_err_per_rank": max(abs(_rel(m, p)) for m, p in zip(measured_acts, predicted_acts, strict=True)),
        })
    return rows


def order_pairs(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each pair of candidates whose predicted step times differ by more than ORDER_GAP, and whether the
    measured medians order them the same way."""
    out = []
    for a, b in itertools.combinations(rows, 2):
        fast, slow = (a, b) if a["predicted_s"] <= b["predicted_s"] else (b, a)
        gap = slow["predicted_s"] / fast["predicted_s"] - 1
        if gap > ORDER_GAP:
            out.append({"faster": fast["candidate"], "slower": slow["candidate"], "predicted_gap": gap,
                        "measured_gap": slow["measured"]["median_s"] / fast["measured"]["median_s"] - 1,
                        "same_order": fast["measured"]["median_s"] < slow["measured"]["median_s"]})
    return out


def run(cfg: PvMConfig) -> dict[str, Any]:
    """Measure; the rows, the order check, the counting overhead, the profiles and the configuration."""
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    per_rank = harness.spawn(_worker, cfg, world=cfg.ranks, timeout_s=3600)
    rows = summarize(per_rank, cfg)
    on, off = per_rank[0]["overhead"]["on"], per_rank[0]["overhead"]["off"]
    overhead = {"on": harness.summarize(on).to_dict(), "off": harness.summarize(off).to_dict(),
                "paired_ratio": statistics.median(a / b for a, b in zip(on, off, strict=True))}
    return {"rows": rows, "order": order_pairs(rows), "overhead": overhead, "counting": per_rank[0]["counting"],
            "link": per_rank[0]["link"], "profiles": per_rank[0]["profiles"], "config": asdict(cfg)}


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.1f}"


def table(part: dict[str, Any]) -> list[list[str]]:
    """Header + one row per candidate."""
    out = [["candidate", "parts per stage", "predicted ms", "measured ms (median)", "min-max (IQR)", "error",
            "met (25%)", "without link ms", "error", "profiled alone ms", "error", "predicted peak act. (max rank)",
            "measured peak", "error", "worst rank error", "met (10%)"]]
    for r in part["rows"]:
        m = r["measured"]
        out.append([r["candidate"], "/".join(map(str, r["groups"])), _ms(r["predicted_s"]), _ms(m["median_s"]),
                    f"{_ms(r['min_s'])}-{_ms(r['max_s'])} ({_ms(m['q1_s'])}-{_ms(m['q3_s'])})",
                    f"{r['time_err']:+.1%}", report._mark(abs(r["time_err"]) <= TIME_TARGET),
                    _ms(r["predicted_no_link_s"]), f"{r['time_err_no_link']:+.1%}",
                    _ms(r["predicted_alone_s"]), f"{r['time_err_alone']:+.1%}",
                    format_bytes(max(r["predicted_acts"])), format_bytes(max(r["measured_acts"])),
                    f"{r['bytes_err']:+.2%}", f"{r['bytes_err_per_rank']:.2%}",
                    report._mark(r["bytes_err_per_rank"] <= BYTES_TARGET)])
    return out


def order_table(part: dict[str, Any]) -> list[list[str]]:
    """Header + one row per pair predicted more than ORDER_GAP apart."""
    out = [["predicted faster", "predicted slower", "predicted gap", "measured gap", "same order"]]
    for p in part["order"]:
        out.append([p["faster"], p["slower"], f"{p['predicted_gap']:+.0%}", f"{p['measured_gap']:+.0%}",
                    report._mark(p["same_order"])])
    return out


def figure(part: dict[str, Any], path: str) -> None:
    """Predicted vs measured step time (every measured step, the median marked) and peak activation bytes."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(11.5, 4.8), dpi=110, layout="constrained")
    ax_t, ax_b = fig.subplots(1, 2)
    rows = part["rows"]
    right = max(r["predicted_s"] for r in rows) * 1.4e3
    top = max(max(r["max_s"] for r in rows) * 1.05e3, right)
    for c, r in enumerate(rows):
        pred = r["predicted_s"] * 1e3
        ax_t.scatter([pred] * len(r["samples"]), [s * 1e3 for s in r["samples"]], color=f"C{c}", s=10, alpha=0.4)
        ax_t.scatter([pred], [r["measured"]["median_s"] * 1e3], color=f"C{c}", s=60, marker="D",
                     edgecolor="black", label=r["candidate"])
        for rank, (p, m) in enumerate(zip(r["predicted_acts"], r["measured_acts"], strict=True)):
            ax_b.scatter([p / 2**20], [m / 2**20], color=f"C{c}", s=40, marker="os^v"[rank % 4],
                         label=r["candidate"] if rank == 0 else None)
    line = [0, right]
    ax_t.plot(line, line, color="black", linewidth=0.8)
    ax_t.fill_between(line, [0.75 * v for v in line], [1.25 * v for v in line], color="grey", alpha=0.15,
                      label="within 25%")
    ax_t.set(xlim=(0, right), ylim=(0, top), xlabel="predicted step time, ms", ylabel="measured step time, ms")
    ax_t.set_title("Step time: every measured step (dots), median (diamond)", fontsize=9.5)
    ax_t.legend(fontsize=7)
    high = max(max(r["predicted_acts"] + r["measured_acts"]) for r in rows) / 2**20 * 1.1
    ax_b.plot([0, high], [0, high], color="black", linewidth=0.8)
    ax_b.fill_between([0, high], [0, 0.9 * high], [0, 1.1 * high], color="grey", alpha=0.15, label="within 10%")
    ax_b.set(xlim=(0, high), ylim=(0, high), xlabel="predicted peak activations, MiB",
             ylabel="measured peak (StepInfo.peak_saved_bytes), MiB")
    ax_b.set_title("Peak live activation bytes, one marker per rank (o s ^ v = rank 0-3)", fontsize=9.5)
    ax_b.legend(fontsize=7)
    fig.savefig(path)


def markdown(part: dict[str, Any], figure_link: str | None) -> str:
    """The generated block of docs/benchmarks.md's prediction-vs-measurement section."""
    meta, cfg, ov, link = part.get("meta", {}), part["config"], part["overhead"], part["link"]
    lines = [f"Run on {meta.get('date', '?')}: `{meta.get('command', '?')}` ({meta.get('wall_s', 0):.0f} s wall); "
             f"load average before / after: {meta.get('load_before', '?')} / {meta.get('load_after', '?')} "
             f"(`uptime` at the start: {meta.get('uptime', '?')}). {meta.get('load_note', '')}", "",
             f"GPT example (n_layer {cfg['n_layer']}, d_model {cfg['d_model']}, batch {cfg['batch_size']} x 64 "
             f"characters), {cfg['ranks']} gloo ranks, {cfg['warmup']} warm-up + {cfg['steps']} measured steps "
             f"per candidate, round-robin. Predictions: rank 0's profile taken with every rank profiling at "
             f"once, and the measured stage-to-stage link (latency {link['latency_s'] * 1e6:.0f} us per message, "
             f"{link['bandwidth'] / 1e6:,.0f} MB/s, from rank 0-1 round trips of 4 and {link['message_bytes']:,} "
             f"bytes); 'without link' leaves the link out (the planner's default), 'profiled alone' uses the "
             f"profile rank 0 took while the others waited (with the link). Parts per stage: how the planner "
             f"merged the 8 profiled parts.", "",
             report.markdown_table(table(part)), "",
             f"Pairs predicted more than {ORDER_GAP:.0%} apart:", "", report.markdown_table(order_table(part)), "",
             f"Saved-bytes counting on the overhead-bound MLP (8 x Linear 256, batch 64, 1F1B, M=8, "
             f"{cfg['ranks']} ranks, {cfg['overhead_steps']} alternating steps each): median step "
             f"{_ms(ov['on']['median_s'])} ms counted vs {_ms(ov['off']['median_s'])} ms not; median paired "
             f"ratio {ov['paired_ratio']:.3f}. In one process (forward + backward of one microbatch of 8 "
             f"rows, fastest of {cfg['overhead_steps']} each, interleaved): {part['counting']['on_s'] * 1e3:.3f} ms "
             f"counted vs {part['counting']['off_s'] * 1e3:.3f} ms, ratio {part['counting']['ratio']:.3f}.", ""]
    if figure_link:
        lines += [f"![Predicted vs measured step time and peak activations]({figure_link})", ""]
    return "\n".join(lines)


def publish(part: dict[str, Any], docs: str) -> None:
    """Draw the figure into docs/img and rewrite the block of docs/benchmarks.md."""
    os.makedirs(os.path.join(docs, "img"), exist_ok=True)
    figure(part, os.path.join(docs, "img", FIGURE))
    report.update_doc(os.path.join(docs, "benchmarks.md"), markdown(part, f"img/{FIGURE}"), BEGIN, END)


def text_report(part: dict[str, Any]) -> str:
    """The tables as text."""
    return "\n".join([report.text_table(table(part)), "", report.text_table(order_table(part)), "",
                      f"counting overhead: paired step ratio {part['overhead']['paired_ratio']:.3f}, one process "
                      f"{part['counting']['ratio']:.3f}; link {part['link']}"])


def _uptime() -> str:
    try:
        return subprocess.run(["uptime"], capture_output=True, text=True, timeout=5).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "?"


def measure(cfg: PvMConfig, command: str, load_note: str) -> dict[str, Any]:
    """run() with the machine's load and the command recorded."""
    uptime, load_before, started = _uptime(), [round(x, 2) for x in os.getloadavg()], time.monotonic()
    part = run(cfg)
    part["meta"] = {"date": time.strftime("%Y-%m-%d %H:%M %Z"), "wall_s": time.monotonic() - started,
                    "command": command, "uptime": uptime, "load_before": load_before,
                    "load_after": [round(x, 2) for x in os.getloadavg()], "load_note": load_note,
                    "machine": harness.machine_info()}
    return part


def main(argv: list[str] | None = None) -> int:
    """Run, print the tables, write OUT/plan_vs_measured.json and (unless --docs none) the docs block and figure."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="2 ranks, a narrow model, 2 candidates, 2 steps")
    parser.add_argument("--out", default=str(ROOT / "bench-output"), help="results directory")
    parser.add_argument("--docs", default=str(ROOT / "docs"), help="docs directory to update; 'none' to skip")
    parser.add_argument("--load-note", default="", help="how loaded the machine was, for the docs")
    parser.add_argument("--replot", action="store_true", help="measure nothing: redraw from OUT/plan_vs_measured.json")
    args = parser.parse_args(argv)
    path = os.path.join(args.out, "plan_vs_measured.json")
    if args.replot:
        with open(path, encoding="utf-8") as fh:
            part = json.load(fh)
    else:
        given = list(sys.argv[1:] if argv is None else argv)
        if "--load-note" in given:
            given[given.index("--load-note") + 1] = "NOTE"
        part = measure(quick_config() if args.quick else PvMConfig(),
                       shlex.join(["python", "benchmarks/plan_vs_measured.py", *given]), args.load_note)
        report.write_json(part, path)
    print(text_report(part))
    if args.docs != "none":
        publish(part, args.docs)
    else:
        figure(part, os.path.join(args.out, FIGURE))
    return 0


if __name__ == "__main__":
    sys.exit(main())
