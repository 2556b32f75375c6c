"""Benchmark figures: ratio bars against their targets, a measured-vs-simulated Gantt, tooling scaling."""

from __future__ import annotations

from typing import Any, Sequence

from benchmarks.report import TARGETS


def _figure(width: float, height: float) -> Any:
    from matplotlib.figure import Figure

    return Figure(figsize=(width, height), dpi=110, layout="constrained")


def _bars(ax: Any, labels: Sequence[str], series: dict[str, list[float]], target: float,
          target_text: str, ylabel: str, title: str) -> None:
    count = max(len(series), 1)
    width = 0.8 / count
    for k, (name, values) in enumerate(series.items()):
        xs = [i + (k - (count - 1) / 2) * width for i in range(len(values))]
        bars = ax.bar(xs, values, width=width * 0.95, label=name)
        for bar, value in zip(bars, values, strict=True):
            ax.annotate(f"{value:.2f}", (bar.get_x() + bar.get_width() / 2, bar.get_height()),
                        xytext=(0, 2), textcoords="offset points", ha="center", va="bottom", fontsize=7)
    ax.axhline(target, color="#c0392b", linestyle="--", linewidth=1)
    ax.annotate(target_text, (1.0, target), xycoords=("axes fraction", "data"), xytext=(-2, 3),
                textcoords="offset points", ha="right", va="bottom", fontsize=7.5, color="#c0392b")
    ax.set_xticks(range(len(labels)), labels, rotation=20, ha="right", fontsize=8)
    ax.set_ylabel(ylabel, fontsize=8.5)
    ax.set_title(title, fontsize=9.5)
    ax.tick_params(axis="y", labelsize=8)
    ax.set_ylim(0, max([target * 1.25] + [v * 1.4 for vals in series.values() for v in vals]))
    if len(series) > 1:
        ax.legend(fontsize=7.5, loc="upper center", ncols=len(series))


def ratio_bars(results: dict[str, Any], path: str) -> None:
    """One panel per part: ours/torch per workload, measured/simulated, overlap and tooling speedups."""
    panels = [k for k in ("vs_torch", "measured_vs_simulated", "overlap") if results.get(k)]
    fig = _figure(10.5, 3.2 * max(len(panels), 1))
    axes = fig.subplots(max(len(panels), 1), 1, squeeze=False)[:, 0]
    row = 0
    if results.get("vs_torch"):
        rows = results["vs_torch"]
        labels = list(dict.fromkeys(r["schedule"] for r in rows))
        series = {}
        for workload in dict.fromkeys(r["workload"] for r in rows):
            by = {r["schedule"]: r["ratio"] for r in rows if r["workload"] == workload}
            series[f"{workload} (target <= {TARGETS[workload]:g})"] = [by.get(s, 0.0) for s in labels]
        _bars(axes[row], labels, series, 1.0, "parity", "median step time, ours / torch",
              "1. duplexpipe runtime vs torch.distributed.pipelining (lower is better)")
        low = TARGETS["overhead-bound, fixed shapes"]
        axes[row].axhline(low, color="#7f8c8d", linestyle=":", linewidth=1,
                          label=f"fixed-shape 1F1B target {low:g}")
        axes[row].legend(fontsize=7.5, loc="upper center", ncols=3)
        row += 1
    if results.get("measured_vs_simulated"):
        rows = results["measured_vs_simulated"]
        _bars(axes[row], [r["schedule"] for r in rows],
              {"step time / simulated makespan": [r["ratio"] for r in rows]},
              TARGETS["measured_vs_simulated"], "target 1.05", "measured / simulated",
              "2. Sleep model: measured step time over simulated makespan (same costs)")
        row += 1
    if results.get("overlap"):
        rows = results["overlap"]
        _bars(axes[row], [r["schedule"] for r in rows], {"waited / async": [r["speedup"] for r in rows]},
              TARGETS["overlap_speedup"], "target 1.3", "step time, waited / async",
              "3. Prefetched receives vs every receive waited at once (higher is better)")
    fig.savefig(path)


def tooling_plot(part: dict[str, Any], path: str) -> None:
    """Total build+lower+verify+simulate time against P (log-log), one line per (schedule, M)."""
    fig = _figure(8.0, 4.4)
    ax = fig.subplots()
    rows = part["rows"]
    for c, name in enumerate(dict.fromkeys(r["schedule"] for r in rows)):
        for k, m in enumerate(sorted({r["M"] for r in rows if r["schedule"] == name})):
            mine = sorted((r for r in rows if r["schedule"] == name and r["M"] == m), key=lambda r: r["P"])
            ax.plot([r["P"] for r in mine], [r["total_s"] for r in mine], marker="o" if k == 0 else "s",
                    linestyle="-" if k == 0 else "--", color=f"C{c}", label=f"{name}, M={m}")
    head = part["headline"]
    ax.plot([head["P"]], [head["total_s"]], marker="*", markersize=12, color="black", linestyle="none",
            label=f"headline {head['schedule']} P={head['P']} M={head['M']}")
    for r in part.get("vs_torch", []):
        ax.plot([r["P"]], [r["torch_get_schedule_ops_s"]], marker="x", markersize=8, linestyle="none",
                color="#c0392b")
    if part.get("vs_torch"):
        ax.plot([], [], marker="x", linestyle="none", color="#c0392b",
                label="torch plan construction (vs our build+lower: table 4b)")
    ax.axhline(TARGETS["dualpipe_p64_m512_s"], color="#c0392b", linestyle=":", linewidth=1)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("ranks P", fontsize=9)
    ax.set_ylabel("seconds", fontsize=9)
    ax.set_title("4. Schedule tooling: build + lower + verify + simulate", fontsize=10)
    ax.legend(fontsize=6.5, ncols=2)
    fig.savefig(path)


def measured_vs_simulated(row: dict[str, Any], path: str) -> None:
    """Gantt of one measured sleep-model step above its simulation with the nominal costs, both in
    seconds on one unscaled time axis (duplexpipe.viz.plot_comparison)."""
    from duplexpipe.schedules.timeline import Timeline
    from duplexpipe.viz import plot_comparison
    from duplexpipe.viz._style import display_name

    measured = Timeline.from_dict(row["measured_timeline"])
    sim = Timeline.from_dict(row["simulated_timeline"])
    name = display_name(row["schedule"])
    costs = row["costs_ms"]
    shown = [
        Timeline(f"{name} measured (duplexpipe runtime, {measured.num_ranks} gloo ranks)", measured.num_ranks,
                 measured.num_microbatches, measured.events, "measured", "s"),
        Timeline(f"{name} simulated (F/I/W = {costs['f']:g}/{costs['i']:g}/{costs['w']:g} ms)", sim.num_ranks,
                 sim.num_microbatches, sim.events, "simulated", "s"),
    ]
    title = (f"{name}: measured step vs simulated makespan, same costs, {measured.num_ranks} ranks, "
             f"{measured.num_microbatches} microbatches")
    plot_comparison(shown, path, title=title)
