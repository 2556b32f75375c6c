"""Report writer: the stdout table, results.json, docs/benchmarks.md sections and the figures."""

from __future__ import annotations

import json
import os
import re
from typing import Any, Callable, Sequence

TARGETS = {
    "overhead-bound": 1.0,
    "compute-bound": 1.0,
    "overhead-bound, fixed shapes": 0.9,
    "measured_vs_simulated": 1.05,
    "overlap_speedup": 1.3,
    "dualpipe_p64_m512_s": 1.0,
    "tooling_speedup_p16_m256": 2.0,
}
"""The targets the report checks each figure against."""

BEGIN = "<!-- bench:results:begin -->"
END = "<!-- bench:results:end -->"


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.1f}"


def _mark(ok: bool) -> str:
    return "yes" if ok else "**no**"


def headline_verdict(part: dict[str, Any]) -> str:
    """One sentence on the DualPipe P=64, M=512 budget."""
    h = part["headline"]
    budget = TARGETS["dualpipe_p64_m512_s"]
    met = "meets" if h["total_s"] < budget else "MISSES"
    return (f"{h['schedule']} P={h['P']} M={h['M']}: build+lower+verify+simulate {h['total_s'] * 1e3:.0f} ms "
            f"(median of {h['repeats']}), {met} the {budget:g} s budget.")


def vs_torch_table(rows: Sequence[dict[str, Any]]) -> list[list[str]]:
    """Header + one row per (workload, schedule) of part 1."""
    out = [["workload", "schedule", "ours ms (median)", "torch ms (median)", "ours IQR", "torch IQR",
            "ours/torch", "paired ratio (median, IQR)", "target", "met", "grads ours", "grads torch"]]
    for r in rows:
        target = TARGETS[r["workload"]]
        iqr = [f"{_ms(r[s]['q1_s'])}-{_ms(r[s]['q3_s'])}" for s in ("ours", "torch")]
        paired = r.get("paired_ratio")
        paired_text = (f"{paired['median_s']:.2f} ({paired['q1_s']:.2f}-{paired['q3_s']:.2f})"
                       if paired else "-")
        out.append([r["workload"], r["schedule"], _ms(r["ours"]["median_s"]), _ms(r["torch"]["median_s"]), *iqr,
                    f"{r['ratio']:.2f}", paired_text, f"<= {target:g}", _mark(r["ratio"] <= target),
                    "match" if r["grads_match"]["ours"] else f"DIFF {r['grad_error']['ours']:.1e}",
                    "match" if r["grads_match"]["torch"] else f"DIFF {r['grad_error']['torch']:.1e}"])
    return out


def sim_table(rows: Sequence[dict[str, Any]]) -> list[list[str]]:
    """Header + one row per schedule of part 2."""
    target = TARGETS["measured_vs_simulated"]
    out = [["schedule", "measured step ms", "trace makespan ms", "simulated ms", "measured/simulated",
            "met", "simulated, calibrated costs ms", "measured/calibrated", "bubble measured",
            "bubble simulated", "handoff gap ms (median / p90)"]]
    for r in rows:
        gap = r["handoff_gap_ms"]
        gap_text = "-" if gap["median"] is None else f"{gap['median']:.2f} / {gap['p90']:.2f}"
        out.append([r["schedule"], _ms(r["step"]["median_s"]), _ms(r["timeline_makespan_s"]),
                    _ms(r["simulated_makespan_s"]), f"{r['ratio']:.3f}", _mark(r["ratio"] <= target),
                    _ms(r["simulated_calibrated_s"]), f"{r['ratio_calibrated']:.3f}",
                    f"{r['bubble_measured']:.1%}", f"{r['bubble_simulated']:.1%}", gap_text])
    return out


def overlap_table(rows: Sequence[dict[str, Any]]) -> list[list[str]]:
    """Header + one row per schedule of part 3."""
    target = TARGETS["overlap_speedup"]
    out = [["schedule", "activation MiB", "compute ms (F, I, W each)", "async ms", "waited ms",
            "waited/async", "target", "met"]]
    for r in rows:
        out.append([r["schedule"], f"{r['activation_mib']:.1f}", f"{r['compute_ms']:g}",
                    _ms(r["async"]["median_s"]), _ms(r["waited"]["median_s"]), f"{r['speedup']:.2f}",
                    f">= {target:g}", _mark(r["speedup"] >= target)])
    return out


def probe_verdict(rows: list[dict[str, Any]]) -> str:
    """One sentence on the isolated two-rank transfer probe."""
    p = rows[0]["probe"]
    return (f"Isolated transfer of {p['mib']:.1f} MiB between two gloo ranks: the receiver waits "
            f"{p['late_post_wait_s'] * 1e3:.2f} ms when it posts the receive after the data was sent, "
            f"{p['early_post_wait_s'] * 1e3:.2f} ms when it posted it in advance.")


def tooling_table(part: dict[str, Any]) -> list[list[str]]:
    """Header + the headline case and one row per (schedule, P, M) of part 4's grid."""
    out = [["schedule", "P", "M", "actions", "build ms", "lower ms", "verify ms", "simulate ms", "total ms"]]
    head = part["headline"]
    for r in [head] + list(part["rows"]):
        out.append([r["schedule"] + (" (headline)" if r is head else ""), str(r["P"]), str(r["M"]),
                    str(r["actions"]), _ms(r["build_s"]), _ms(r["lower_s"]), _ms(r["verify_s"]),
                    _ms(r["simulate_s"]), _ms(r["total_s"])])
    return out


def tooling_torch_table(part: dict[str, Any]) -> list[list[str]]:
    """Header + one row per torch comparison of part 4."""
    target = TARGETS["tooling_speedup_p16_m256"]
    out = [["schedule", "torch class", "P", "M", "ours build+lower ms", "torch plan ms", "torch/ours", "met"]]
    for r in part["vs_torch"]:
        judged = r["P"] == 16 and r["M"] == 256
        out.append([r["schedule"], r["torch_schedule"], str(r["P"]), str(r["M"]),
                    _ms(r["ours_build_lower_s"]), _ms(r["torch_get_schedule_ops_s"]), f"{r['speedup']:.1f}x",
                    _mark(r["speedup"] >= target) if judged else "-"])
    return out


def text_table(table: list[list[str]]) -> str:
    """Fixed-width text for stdout."""
    widths = [max(len(row[c].replace("**", "")) for row in table) for c in range(len(table[0]))]
    lines = []
    for i, row in enumerate(table):
        lines.append("  ".join(cell.replace("**", "").ljust(w) for cell, w in zip(row, widths, strict=True)))
        if i == 0:
            lines.append("  ".join("-" * w for w in widths))
    return "\n".join(lines)


def markdown_table(table: list[list[str]]) -> str:
    """GitHub markdown."""
    head, *body = table
    lines = ["| " + " | ".join(head) + " |", "|" + "|".join("---" for _ in head) + "|"]
    lines += ["| " + " | ".join(row) + " |" for row in body]
    return "\n".join(lines)


def profile_table(part: dict[str, Any]) -> list[list[str]]:
    """Header + one row per time bucket of a rank's step, both sides (ms per step under py-spy)."""
    out = [["case", "side", "where the step time goes", "ms per step and rank", "share"]]
    if part.get("skipped"):
        out.append(["-", "-", f"not profiled: {part['skipped']}", "-", "-"])
    for case in part["cases"]:
        for side in ("ours", "torch"):
            prof = case[side]
            for label, ms in prof["ms_per_step_rank"].items():
                out.append([f"{case['schedule']}, {case['workload']}", side, label, f"{ms:.2f}",
                            f"{prof['share'][label]:.1%}"])
    return out


def whatif_table(part: dict[str, Any]) -> list[list[str]]:
    """Header + one row per runtime variant of the what-if runs (median step ms, speedup)."""
    out = [["what-if run", "runtime variant", "median step ms", "speedup vs as shipped"]]
    for key in ("whatif", "whatif_sleep"):
        w = part.get(key)
        if not w:
            continue
        for variant, med in w["median_s"].items():
            out.append([f"{w['schedule']}, {w['workload']} model", variant, _ms(med),
                        f"{w['speedup'][variant]:.2f}x"])
    return out


SECTIONS = (
    ("vs_torch", "1. Runtime vs torch.distributed.pipelining", vs_torch_table),
    ("measured_vs_simulated", "2. Measured vs simulated (sleep model)", sim_table),
    ("overlap", "3. Communication overlap", overlap_table),
    ("tooling", "4. Schedule tooling scaling: build + lower + verify + simulate", tooling_table),
    ("tooling", "4b. Plan construction: duplexpipe build + lower vs torch", tooling_torch_table),
    ("profile", "5. Profile (py-spy, --idle): where a rank's step time goes", profile_table),
)


def stdout_report(results: dict[str, Any]) -> str:
    """All tables as fixed-width text."""
    parts = []
    for key, title, fn in SECTIONS:
        rows = results.get(key)
        if rows:
            parts.append(f"{title}\n{text_table(fn(rows))}")
            if fn is tooling_table:
                parts.append(headline_verdict(rows))
            if fn is profile_table and rows.get("whatif"):
                parts.append("What-if runs (A/B per step on one runtime)\n" + text_table(whatif_table(rows)))
            if fn is overlap_table:
                parts.append(probe_verdict(rows))
    return "\n\n".join(parts)


def write_json(results: dict[str, Any], path: str) -> None:
    """Write every figure as JSON."""
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "w", encoding="utf-8") as fh:
        json.dump(results, fh, indent=1)
        fh.write("\n")


def results_markdown(results: dict[str, Any], figures: Sequence[tuple[str, str]]) -> str:
    """The generated part of docs/benchmarks.md: run facts, tables, figures."""
    meta = results["meta"]
    m = meta["machine"]
    lines = [
        f"Run on {meta['date']}: `{meta['command']}` ({meta['wall_s']:.0f} s wall).",
        "",
        f"- Machine: {m['cpu']}, {m['cores']} cores, {m['platform']}, Python {m['python']}, "
        f"torch {m['torch']}.",
        f"- Load average before / after the run (1, 5, 15 min): {m['loadavg_1_5_15']} / "
        f"{meta['loadavg_after']}.",
        "- 1-minute load average when each part started: "
        + ", ".join(f"{k} {v[0]}" for k, v in meta.get("loadavg_at_part_start", {}).items()) + ".",
        "- Wall time per part (s): "
        + ", ".join(f"{k} {v:.0f}" for k, v in meta.get("part_wall_s", {}).items()) + ".",
        f"- {meta['load_note']}",
        "",
    ]
    for key, title, fn in SECTIONS:
        rows = results.get(key)
        if rows:
            lines += [f"### {title}", "", markdown_table(fn(rows)), ""]
            if fn is tooling_table:
                lines += [headline_verdict(rows), ""]
            if fn is profile_table and rows.get("whatif"):
                lines += ["What-if runs (two runtimes in the same processes, one step of each per round, "
                          "order rotating):", "",
                          markdown_table(whatif_table(rows)), ""]
            if fn is overlap_table:
                lines += [probe_verdict(rows), ""]
    for path, caption in figures:
        lines += [f"![{caption}]({path})", ""]
    return "\n".join(lines)


def update_doc(doc_path: str, generated: str, begin: str = BEGIN, end: str = END) -> None:
    """Replace the text between the `begin` and `end` markers of `doc_path` (append the block if absent)."""
    try:
        with open(doc_path, encoding="utf-8") as fh:
            text = fh.read()
    except FileNotFoundError:
        text = "# Benchmarks\n\n"
    block = f"{begin}\n{generated.rstrip()}\n{end}"
    pattern = re.compile(re.escape(begin) + r".*?" + re.escape(end), re.S)
    if pattern.search(text):
        text = pattern.sub(lambda _: block, text)
    else:
        text = text.rstrip() + "\n\n" + block + "\n"
    with open(doc_path, "w", encoding="utf-8") as fh:
        fh.write(text)


def save_and_publish(result: dict[str, Any], json_path: Any, docs: str | None,
                     publish: Callable[[dict[str, Any], str], None]) -> None:
    """A benchmark script's last step: `result` to `json_path` (a Path, when given) and its docs section into
    `docs` (when given)."""
    if json_path:
        json_path.write_text(json.dumps(result, indent=1) + "\n", encoding="utf-8")
    if docs:
        publish(result, docs)
