"""The tables, figure and sentences of the plan_vs_measured part (from its JSON result)."""

from __future__ import annotations

import math
import os
from types import MappingProxyType
from typing import Any

from benchmarks.framework import Block, Result, figure, mark, ms
from benchmarks.internals import format_bytes

TIME_TARGET = 0.25  # |measured - predicted| / predicted step time, at most
BYTES_TARGET = 0.10  # |measured - predicted| / predicted peak activation bytes, at most
ORDER_GAP = 0.15  # candidates predicted more than this fraction apart must be measured in that order
FIGURE = "plan_vs_measured.png"
SHORT = MappingProxyType({"previous": "previous model (1-weight calibration)", "no_cores": "device per rank",
                          "cores_only": "C cores only", "alone_linear": "alone, linear", "old": "old prediction"})
"""Column titles of the comparison predictions."""


def table(part: dict[str, Any]) -> list[list[str]]:
    """Header + one row per candidate: the new model's prediction, the measurement, the comparisons."""
    head = ["candidate", "parts per stage", "predicted ms", "measured ms (median)", "min-max (IQR)", "error",
            "met (25%)"]
    for title in SHORT.values():
        head += [f"{title} ms", "error"]
    out = [head + ["predicted peak act. (max rank)", "measured peak", "error", "worst rank error", "met (10%)"]]
    for r in part["rows"]:
        m = r["measured"]
        line = [r["candidate"], "/".join(map(str, r["groups"])), ms(r["predicted_s"]), ms(m["median_s"]),
                f"{ms(r['min_s'])}-{ms(r['max_s'])} ({ms(m['q1_s'])}-{ms(m['q3_s'])})",
                f"{r['time_err']:+.1%}", mark(abs(r["time_err"]) <= TIME_TARGET)]
        for key in SHORT:
            v = r["variants"][key]
            line += [ms(v["step_s"]), f"{v['err']:+.1%}"]
        out.append(line + [format_bytes(max(r["predicted_acts"])), format_bytes(max(r["measured_acts"])),
                           f"{r['bytes_err']:+.2%}", f"{r['bytes_err_per_rank']:.2%}",
                           mark(r["bytes_err_per_rank"] <= BYTES_TARGET)])
    return out


def order_table(part: dict[str, Any]) -> list[list[str]]:
    """Header + one row per pair predicted more than ORDER_GAP apart."""
    return [["predicted faster", "predicted slower", "predicted gap", "measured gap", "same order"]] + [
        [p["faster"], p["slower"], f"{p['predicted_gap']:+.0%}", f"{p['measured_gap']:+.0%}", mark(p["same_order"])]
        for p in part["order"]]


def calibration_table(part: dict[str, Any]) -> list[list[str]]:
    """Header + each model's prediction of its own calibration runs (new: real parts; previous: 1-weight parts)."""
    out = [["calibration run", "model", "predicted ms", "measured ms (median)", "error"]]
    for key, title in (("in_pipeline", "new (real parts)"), ("calibration", "previous (1-weight parts)")):
        for c in part.get(key, {}).get("check", []):
            err = (c["measured_s"] - c["predicted_s"]) / c["predicted_s"]
            out.append([c["run"], title, *(f"{c[k] * 1e3:.2f}" for k in ("predicted_s", "measured_s")), f"{err:+.1%}"])
    return out


def cpu_table(part: dict[str, Any]) -> list[list[str]]:
    """Header + per candidate: the CPU per step the models charge (all ranks) against the ranks' measured CPU time."""
    cores = part["calibration"]["cores"]
    out = [["candidate", "model CPU ms (all ranks)", "measured CPU ms (all ranks)", "measured / model",
            "previous model CPU ms", "measured / previous", f"measured CPU / {cores} cores ms", "measured step ms"]]
    for r in part["rows"]:
        model, real = sum(r["cpu_model"]), sum(r["cpu"])
        previous = sum(r.get("cpu_previous", [math.nan]))
        out.append([r["candidate"], ms(model), ms(real), f"{real / model:.2f}", ms(previous),
                    f"{real / previous:.2f}", ms(real / cores), ms(r["measured"]["median_s"])])
    return out


def _model_note(part: dict[str, Any]) -> str:
    """How every term of the new model was measured, with its values."""
    cal, link = part["calibration"], part["link"]
    o, n = cal["overhead"], part["in_pipeline"]["overhead"]
    if n is None:  # the in-pipeline calibration could not separate its terms: the previous model stands in
        n = dict(o, method=f"FAILED, the previous model's terms used instead: {part['in_pipeline']['error']}")
    alone = part["profiles"]["alone"]
    return (f"The new model ('predicted'): rank 0's profile taken alone (the other ranks waiting; fastest of "
            f"{alone['meta']['repeats']}, round by round over the parts), each pass affine in the rows (timed "
            f"at {alone['microbatch_size']} and {alone['meta']['fit_rows']} rows, the candidates' largest and "
            f"smallest microbatch), a full B timed as one fused pass, each pass after writing "
            f"{alone['meta'].get('evict_bytes', 0) / 2**20:.3g} MiB (the activations one microbatch keeps through the "
            f"whole model, what a 1F1B rank holds at its peak, at least twice the per-core L2: the caches are as "
            f"cold as between a part's passes in a pipeline); each rank's CPU per step as alpha x its "
            f"profiled compute + work per compute action, per SEND/RECV and per step, from a calibration "
            f"with the real parts on the same {part['config']['ranks']} ranks ({n['method']}; the parts merged "
            f"as the planner groups them, AdamW and clipping as in the candidates): alpha = "
            f"{n['compute_scale']:.3f}, {n['action_s'] * 1e6:.0f} us per compute action, {n['message_s'] * 1e6:.0f} "
            f"us per SEND/RECV, {n['step_s'] * 1e6:.0f} us per step (the previous model: alpha = 1 and the "
            f"runtime's work from {o['method']}: {o['action_s'] * 1e6:.0f} us per compute action, "
            f"{o['message_s'] * 1e6:.0f} us per SEND/RECV, {o['step_s'] * 1e6:.0f} us per step); the "
            f"stage-to-stage link (latency "
            f"{link['latency_s'] * 1e6:.0f} us per message, {link['bandwidth'] / 1e6:,.0f} MB/s, from rank 0-1 "
            f"round trips of 4 and {link['message_bytes']:,} bytes); and C = {cal['cores']} cores shared by the "
            f"ranks (`os.sched_getaffinity`), simulated with processor sharing. Comparisons: "
            + "; ".join(f"'{SHORT[k]}': {part['variants'][k]}" for k in SHORT) + ".")


def report(part: Result) -> list[Block]:
    """How the candidates ran, how the model was measured, the tables, and the counting overhead."""
    cfg, ov = part["config"], part["overhead"]
    return [f"GPT example (n_layer {cfg['n_layer']}, d_model {cfg['d_model']}, batch {cfg['batch_size']} x 64 "
            f"characters), {cfg['ranks']} gloo ranks, {cfg['warmup']} warm-up + {cfg['steps']} measured steps per "
            f"candidate, round-robin. {_model_note(part)} Parts per stage: how the planner merged the "
            f"{2 * cfg['ranks']} profiled parts (each comparison groups by its own profile).", table(part),
            f"Pairs predicted more than {ORDER_GAP:.0%} apart (new model):", order_table(part),
            "The model on its own calibration runs (not a fit of the step: the solver fits CPU time per rank):",
            calibration_table(part),
            "CPU time per step (each rank's process, `time.process_time`, median of the measured steps):",
            cpu_table(part),
            f"Saved-bytes counting on the overhead-bound MLP (8 x Linear 256, batch 64, 1F1B, M=8, {cfg['ranks']} "
            f"ranks, {cfg['overhead_steps']} alternating steps each): median step {ms(ov['on']['median_s'])} ms "
            f"counted vs {ms(ov['off']['median_s'])} ms not; median paired ratio {ov['paired_ratio']:.3f}. In one "
            f"process (forward + backward of one microbatch of 8 rows, fastest of {max(3, cfg['overhead_steps'])} "
            f"each, interleaved): {part['counting']['on_s'] * 1e3:.3f} ms counted vs "
            f"{part['counting']['off_s'] * 1e3:.3f} ms, ratio {part['counting']['ratio']:.3f}."]


def figures(part: Result, folder: str) -> list[tuple[str, str]]:
    """Predicted vs measured step time (every step, the median, the old prediction hollow) and peak activations."""
    fig = figure(11.5, 4.8)
    ax_t, ax_b = fig.subplots(1, 2)
    rows = part["rows"]
    right = max(max(r["predicted_s"], r["variants"]["old"]["step_s"]) for r in rows) * 1.4e3
    top = max(max(r["max_s"] for r in rows) * 1.05e3, right)
    for c, r in enumerate(rows):
        pred, median = r["predicted_s"] * 1e3, r["measured"]["median_s"] * 1e3
        ax_t.scatter([pred] * len(r["samples"]), [s * 1e3 for s in r["samples"]], color=f"C{c}", s=10, alpha=0.4)
        ax_t.scatter([pred], [median], color=f"C{c}", s=60, marker="D", edgecolor="black", label=r["candidate"])
        ax_t.scatter([r["variants"]["old"]["step_s"] * 1e3], [median], s=60, marker="D", facecolor="none",
                     edgecolor=f"C{c}")
        for rank, (p, m) in enumerate(zip(r["predicted_acts"], r["measured_acts"], strict=True)):
            ax_b.scatter([p / 2**20], [m / 2**20], color=f"C{c}", s=40, marker="os^v"[rank % 4],
                         label=r["candidate"] if rank == 0 else None)
    line = [0, right]
    ax_t.plot(line, line, color="black", linewidth=0.8)
    ax_t.fill_between(line, [0.75 * v for v in line], [1.25 * v for v in line], color="grey", alpha=0.15,
                      label="within 25%")
    ax_t.set(xlim=(0, right), ylim=(0, top), xlabel="predicted step time, ms", ylabel="measured step time, ms")
    ax_t.set_title("Step time: steps (dots), median (diamond); hollow: the old prediction", fontsize=9.5)
    ax_t.legend(fontsize=7)
    high = max(max(r["predicted_acts"] + r["measured_acts"]) for r in rows) / 2**20 * 1.1
    ax_b.plot([0, high], [0, high], color="black", linewidth=0.8)
    ax_b.fill_between([0, high], [0, 0.9 * high], [0, 1.1 * high], color="grey", alpha=0.15, label="within 10%")
    ax_b.set(xlim=(0, high), ylim=(0, high), xlabel="predicted peak activations, MiB",
             ylabel="measured peak (StepInfo.peak_saved_bytes), MiB")
    ax_b.set_title("Peak live activation bytes, one marker per rank (o s ^ v = rank 0-3)", fontsize=9.5)
    ax_b.legend(fontsize=7)
    fig.savefig(os.path.join(folder, FIGURE))
    return [(FIGURE, "Predicted vs measured step time and peak activations")]


