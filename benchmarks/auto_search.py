"""Part: the `auto` schedule search against the hand-made schedules and lower bounds, in simulation."""

from __future__ import annotations

import itertools
import json
import os
import time
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import Any

from benchmarks import runner
from benchmarks.framework import Block, Part, Result, figure, met
from benchmarks.internals import check_schedule, makespan_bound, search, search_problem
from duplexpipe import CostModel, Schedule, build_schedule, simulate

BUILT_INS = ("gpipe", "1f1b", "interleaved-1f1b", "zb-h1", "zb-h2", "zbv", "dualpipe", "dualpipev")
EPS = 1e-9


@dataclass(frozen=True)
class Profile:
    """Costs of each 1/P share of the model (F, B = I + W, W) and the message latency."""

    name: str  # label in the tables
    f: float  # forward of a share
    b: float  # full backward of a share
    w: float  # its weight-gradient part
    latency: float = 0.0  # time of one message between ranks
    heavy_last: float = 1.0  # the last share's costs are this many times the others'

    def shares(self, ranks: int) -> list[tuple[float, float, float]]:
        """(F, B, W) of each of the P shares."""
        k = self.heavy_last
        return [(self.f, self.b, self.w)] * (ranks - 1) + [(self.f * k, self.b * k, self.w * k)]


UNIFORM = Profile("F=1 B=2 W=1", 1.0, 2.0, 1.0)
LATENCY = Profile("F=1 B=2 W=1 latency 0.5", 1.0, 2.0, 1.0, 0.5)
W_LIGHT = Profile("F=1 B=2.5 W=0.5", 1.0, 2.5, 0.5)
GRID_PROFILES = (UNIFORM, LATENCY, W_LIGHT,
                 *(Profile(p.name + ", last 1.5x", p.f, p.b, p.w, p.latency, 1.5) for p in (UNIFORM, LATENCY, W_LIGHT)))


def cost_for(schedule: Schedule, profile: Profile) -> CostModel:
    """Per-stage costs of `schedule`: its model part g of G covers the shares it overlaps (stage_scale built in)."""
    ranks, groups, shares = schedule.num_ranks, schedule.num_groups, profile.shares(schedule.num_ranks)
    table = {}
    for stage, info in enumerate(schedule.stages):
        lo, hi = info.group / groups, (info.group + 1) / groups
        overlap = [max(0.0, min(hi, (k + 1) / ranks) - max(lo, k / ranks)) * ranks for k in range(ranks)]
        f, b, w = (sum(o * share[j] for o, share in zip(overlap, shares, strict=True)) for j in range(3))
        table[stage] = (f, b, w)
    return CostModel(stage_costs=table, latency=profile.latency)


def bounds(ranks: int, mbs: int, profile: Profile, limit: float) -> dict[str, float]:
    """Lower bounds on the makespan of one-stage-per-rank schedules holding at most `limit` activations. lb: (P-1)(F +
    latency) + M(F + B); memory_aware: also, rank r runs at most `limit` forwards before its first input-gradient
    returns, a round trip RT_r after its first forward; two_sided: also, after its last forward a rank holds at most
    limit-1 other microbatches' I and W while that forward's gradient makes the same round trip."""
    shares = profile.shares(ranks)
    f, b, w = ([s[j] for s in shares] for j in range(3))
    i = [bb - ww for bb, ww in zip(b, w, strict=True)]
    lat, n = profile.latency, limit
    per_rank = []
    for r in range(ranks):
        start = sum(f[q] + lat for q in range(r))
        trip = sum(f[r:]) + sum(i[r + 1:]) + 2 * (ranks - 1 - r) * lat
        work = mbs * (f[r] + b[r])
        head = max(0.0, trip - min(n, mbs) * f[r])
        tail = max(0.0, trip - f[r] - (n - 1) * (i[r] + w[r])) if mbs > n else 0.0
        per_rank.append((start + work, start + work + head, start + work + head + tail))
    return {k: max(v) for k, v in zip(("lb", "memory_aware", "two_sided"), zip(*per_rank, strict=True), strict=True)}


def v_bound(ranks: int, mbs: int, profile: Profile, limit: float) -> float:
    """The same two-sided bound for the V placement (2P half-size stages, `bounds.makespan_bound`)."""
    cost = cost_for(build_schedule("zbv", ranks, mbs), profile)
    return makespan_bound(search_problem(ranks, mbs, cost=cost, memory_limit=limit, placement="v"))


def _search(ranks: int, mbs: int, profile: Profile, limit: float, placement: str) -> Any:
    table = build_schedule("1f1b" if placement == "linear" else "zbv", ranks, mbs)
    return search(ranks, mbs, cost=cost_for(table, profile), memory_limit=limit, placement=placement)


def built_ins(ranks: int, mbs: int, profile: Profile) -> dict[str, tuple[float, float]]:
    """name -> (makespan, peak activation memory in 1F1B-stage units) of every built-in the registry accepts."""
    out = {}
    for name in BUILT_INS:
        if check_schedule(name, ranks, mbs) is None:
            schedule = build_schedule(name, ranks, mbs)
            timeline = simulate(schedule, cost_for(schedule, profile))
            out[name] = (timeline.makespan,
                         max(timeline.peak_activations(r) for r in range(ranks)) * ranks / schedule.num_groups)
    return out


def run_auto(ranks: int, mbs: int, profile: Profile, limit: float) -> dict[str, Any]:
    """Both placements; the better one is auto's answer."""
    rows = []
    for placement in ("linear", "v"):
        wall, cpu = time.perf_counter(), time.process_time()
        result = _search(ranks, mbs, profile, limit, placement)
        rows.append({"placement": placement, "makespan": result.winner.makespan, "winner": result.winner.label,
                     "peak": result.winner.peak, "wall_s": time.perf_counter() - wall,
                     "cpu_s": time.process_time() - cpu})
    linear, v = rows
    best = v if v["makespan"] < linear["makespan"] - EPS else linear
    return {**best, "by_placement": {r["placement"]: r["makespan"] for r in rows}}


PLACEMENT = MappingProxyType({"gpipe": "linear", "1f1b": "linear", "zb-h1": "linear", "zb-h2": "linear",
                              "zbv": "v", "dualpipev": "v"})  # the built-ins whose placement a bound covers
TWO_COPIES = ("dualpipe",)  # built-ins with two copies of the parameters: no same-memory rival (shown beside)


def case(ranks: int, mbs: int, profile: Profile, limit: float) -> dict[str, Any]:
    """One comparison: bounds, every fitting built-in (the best one with one parameter copy), and auto."""
    every = built_ins(ranks, mbs, profile)
    rivals = {k: v for k, v in every.items() if v[1] <= limit + EPS}  # the built-ins that fit the limit
    name, (span, _) = min(((k, v) for k, v in rivals.items() if k not in TWO_COPIES), key=lambda kv: kv[1][0])
    everything = {k: v[0] for k, v in rivals.items()} | {f"{k} (over limit)": every[k][0] for k in ("zb-h1", "zb-h2")
                                                          if k not in rivals}
    linear = bounds(ranks, mbs, profile, limit)
    v = v_bound(ranks, mbs, profile, limit) if ranks >= 2 else linear["two_sided"]
    auto = run_auto(ranks, mbs, profile, limit)
    own = {"linear": linear["two_sided"], "v": v}
    checked = [(k, span, own[PLACEMENT[k]]) for k, (span, _) in rivals.items() if k in PLACEMENT]
    checked += [(f"auto {k}", span, own[k]) for k, span in auto["by_placement"].items()]
    return {"P": ranks, "M": mbs, "profile": profile.name, "limit": limit, **linear, "v_bound": v,
            "bound": min(linear["two_sided"], v), "built_ins": everything, "best_built_in": name,
            "best_built_in_makespan": span, "auto": auto, "bound_checked": len(checked),
            "bound_reached": sum(abs(span - bound) <= EPS for _, span, bound in checked),
            "bound_violated": [k for k, span, bound in checked if span < bound - EPS]}


@dataclass(frozen=True)
class AutoSearchConfig:
    """The shapes each section simulates, and which sections run."""

    first: tuple[tuple[int, int], ...] = ((8, 24),)  # (P, M) of the uniform-cost target
    big: tuple[tuple[int, int], ...] = ((8, 32), (16, 64))  # (P, M) of the latency and W-light targets
    grid_ranks: tuple[int, ...] = (4, 8, 16)  # P of the grid (M = 2P, 4P, 8P)
    sweep: tuple[int, int] = (8, 32)  # (P, M) of the limit sweep
    search_time: tuple[int, int] = (16, 128)  # (P, M) whose search is timed
    sections: tuple[str, ...] = ("targets", "grid", "sweep", "search_time")  # search_time alone is a timing
    keep_from: str = ""  # a results.json whose other sections this run keeps (e.g. time the search on a quiet machine)


QUICK = AutoSearchConfig(((4, 12),), ((4, 8),), (2, 4), (4, 8), (4, 16))


def targets(cfg: AutoSearchConfig) -> list[dict[str, Any]]:
    """The issue's targets, each with its cases and its verdict."""
    shapes = ((UNIFORM, cfg.first), (LATENCY, cfg.big), (W_LIGHT, cfg.big))
    uniform, latency, light = ([case(p, m, prof, p) for p, m in pms] for prof, pms in shapes)
    doubled = [case(p, m, prof, 2 * p) for prof, pms in shapes for p, m in pms]

    def within(cases: list[dict[str, Any]], rival: str, factor: float = 1.0, bound: bool = False) -> bool:
        """Every case's auto makespan (or bound) at most `factor` x the rival's."""
        return all((c["bound"] if bound else c["auto"]["makespan"]) <= factor * c["built_ins"][rival] + EPS
                   for c in cases)

    return [{"target": "uniform costs, no latency, limit P: auto = LB (one stage per rank; V may go below)",
             "cases": uniform, "met": all(abs(c["auto"]["by_placement"]["linear"] - c["lb"]) <= EPS
                                          and c["auto"]["makespan"] <= c["lb"] + EPS for c in uniform)},
            {"target": "latency 0.5, limit P: at least 3% shorter than zb-h1", "cases": latency,
             "met": within(latency, "zb-h1", 0.97), "reachable": within(latency, "zb-h1", 0.97, bound=True)},
            {"target": "W-light (F=1 B=2.5 W=0.5), limit P: no worse than zb-h1", "cases": light,
             "met": within(light, "zb-h1")},
            {"target": "limit 2P: no worse than zb-h2 on every case above", "cases": doubled,
             "met": within(doubled, "zb-h2")}]


def grid(cfg: AutoSearchConfig) -> dict[str, Any]:
    """P x M x cost profile x limit: auto never worse than the best built-in under the same limit."""
    rows = [case(p, k * p, prof, lim) for p in cfg.grid_ranks for k in (2, 4, 8) for prof in GRID_PROFILES
            for lim in (p, 2 * p)]
    worse = [r for r in rows if r["auto"]["makespan"] > r["best_built_in_makespan"] + EPS]
    better = [r for r in rows if r["auto"]["makespan"] < r["best_built_in_makespan"] - EPS]
    dual = [r for r in rows if "dualpipe" in r["built_ins"]]
    return {"rows": rows, "cases": len(rows), "worse": len(worse), "better": len(better), "met": not worse,
            "greedy_wins": sum(r["auto"]["winner"].startswith("greedy") for r in better),
            "at_bound": sum(r["auto"]["makespan"] <= r["bound"] + EPS for r in rows),
            **{k: sum(r[k] for r in rows) for k in ("bound_checked", "bound_reached")},
            "bound_violated": [f"P={r['P']} M={r['M']} {r['profile']} limit {r['limit']:g}: {k}"
                               for r in rows for k in r["bound_violated"]], "dualpipe_cases": len(dual),
            "dualpipe_shorter": sum(r["built_ins"]["dualpipe"] < r["auto"]["makespan"] - EPS for r in dual)}


def search_time(cfg: AutoSearchConfig) -> dict[str, Any]:
    """Wall and CPU seconds of the search (both placements, two cost profiles, limits P and 2P)."""
    ranks, mbs = cfg.search_time
    rows: list[dict[str, Any]] = []
    for profile, limit, placement in itertools.product((UNIFORM, LATENCY), (ranks, 2 * ranks), ("linear", "v")):
        wall, cpu = time.perf_counter(), time.process_time()
        _search(ranks, mbs, profile, limit, placement)
        rows.append({"profile": profile.name, "limit": limit, "placement": placement,
                     "wall_s": time.perf_counter() - wall, "cpu_s": time.process_time() - cpu})
    worst = max(r["wall_s"] for r in rows)
    return {"P": ranks, "M": mbs, "rows": rows, "max_wall_s": worst, "met": worst < 10.0,
            "loadavg": [round(x, 2) for x in os.getloadavg()]}


def limit_sweep(cfg: AutoSearchConfig) -> dict[str, Any]:
    """The latency target's case under growing limits: both placements' bounds and auto's result for each."""
    ranks, mbs = cfg.sweep
    h1 = simulate(build_schedule("zb-h1", ranks, mbs), cost_for(build_schedule("zb-h1", ranks, mbs), LATENCY))
    rows = [{"limit": limit, "linear_bound": bounds(ranks, mbs, LATENCY, limit)["two_sided"],
             "v_bound": v_bound(ranks, mbs, LATENCY, limit),
             **{p: _search(ranks, mbs, LATENCY, limit, p).winner.makespan for p in ("linear", "v")}}
            for limit in (factor * ranks for factor in (1.0, 1.125, 1.25, 1.375, 1.5, 2.0))]
    return {"P": ranks, "M": mbs, "zb_h1": h1.makespan, "rows": rows}


SECTIONS = MappingProxyType({"targets": targets, "grid": grid, "sweep": limit_sweep, "search_time": search_time})


def run(cfg: AutoSearchConfig) -> Result:
    """The chosen sections; the others kept from `cfg.keep_from` when given."""
    unknown = set(cfg.sections) - set(SECTIONS)
    if unknown:
        raise ValueError(f"unknown sections {sorted(unknown)}; choose from {', '.join(SECTIONS)}")
    earlier = json.loads(Path(cfg.keep_from).read_text(encoding="utf-8")) if cfg.keep_from else {}
    out = {k: v for k, v in earlier.get("auto_search", {}).items() if k in SECTIONS}
    return {**out, **{name: SECTIONS[name](cfg) for name in cfg.sections}}


def _f(x: float) -> str:
    return f"{x:.4g}"


def _verdict(target: dict[str, Any]) -> str:
    """"met", or "missed", saying so when the bounds prove the target out of reach."""
    return ("**missed**: unreachable (bound > target)" if not target["met"] and target.get("reachable") is False
            else met(target["met"]))


def target_table(results: dict[str, Any]) -> list[list[str]]:
    """Header + one row per (target, case)."""
    out = [["target", "P", "M", "limit", "LB", "memory-aware bound", "two-sided bound", "V bound", "zb-h1", "zb-h2",
            "best built-in (1 copy)", "dualpipe (2 copies)", "auto linear / v", "auto (winner)", "met"]]
    for t in results["targets"]:
        for c in t["cases"]:
            bi, a = c["built_ins"], c["auto"]
            out.append([t["target"], str(c["P"]), str(c["M"]), *(_f(c[k]) for k in (
                        "limit", "lb", "memory_aware", "two_sided", "v_bound")),
                        *(_f(bi.get(k, bi.get(k + " (over limit)"))) + ("" if k in bi else " (over)")
                          for k in ("zb-h1", "zb-h2")), f"{c['best_built_in']} {_f(c['best_built_in_makespan'])}",
                        _f(bi["dualpipe"]) if "dualpipe" in bi else "-",
                        " / ".join(_f(a["by_placement"][k]) for k in ("linear", "v")),
                        f"**{_f(a['makespan'])}** ({a['placement']}: {a['winner']})", _verdict(t)])
    return out


def grid_table(results: dict[str, Any]) -> list[list[str]]:
    """Header + the grid's cases where auto differs from the best built-in."""
    return [["P", "M", "costs", "limit", "bound", "best built-in (1 copy)", "dualpipe (2 copies)", "auto",
             "auto / best", "auto's winner"]] + [
        [str(r["P"]), str(r["M"]), r["profile"], _f(r["limit"]), _f(r["bound"]),
         f"{r['best_built_in']} {_f(r['best_built_in_makespan'])}",
         _f(r["built_ins"]["dualpipe"]) if "dualpipe" in r["built_ins"] else "-", _f(r["auto"]["makespan"]),
         f"{r['auto']['makespan'] / r['best_built_in_makespan']:.3f}", "{placement}: {winner}".format(**r["auto"])]
        for r in results["grid"]["rows"] if abs(r["auto"]["makespan"] - r["best_built_in_makespan"]) > EPS]


def sweep_table(sweep: dict[str, Any]) -> list[list[str]]:
    """Header + one row per limit of the limit sweep."""
    target = 0.97 * sweep["zb_h1"]
    return [["limit", "bound: one stage per rank", "bound: V", "auto linear", "auto v", "auto / zb-h1",
             f"<= 0.97 zb-h1 ({target:.2f})"]] + [
        [*(_f(r[k]) for k in ("limit", "linear_bound", "v_bound", "linear", "v")),
         f"{min(r['linear'], r['v']) / sweep['zb_h1']:.3f}", "yes" if min(r["linear"], r["v"]) <= target + EPS else
         "no (unreachable)" if min(r["linear_bound"], r["v_bound"]) > target + EPS else "no"] for r in sweep["rows"]]


def report(result: Result) -> list[Block]:
    """The targets, the grid's differing cases, the limit sweep and the search time (the sections present)."""
    out: list[Block] = []
    if "targets" in result:
        out += ["### Targets", target_table(result)]
    g = result.get("grid")
    if g:
        out += [f"### Grid: {g['cases']} cases, auto never worse than the best built-in under the same limit: "
                f"{met(g['met'])}",
                f"auto is shorter than every built-in that fits in {g['better']} cases (the greedy's own schedule in "
                f"{g['greedy_wins']} of them), equal in {g['cases'] - g['better'] - g['worse']}, longer in "
                f"{g['worse']}. DualPipe holds two copies of the parameters, so it is no same-memory rival: it fits "
                f"the activation limit in {g['dualpipe_cases']} cases and is shorter than auto in "
                f"{g['dualpipe_shorter']}. auto reaches the lower bound (the smaller of the two placements' "
                f"two-sided bounds: no schedule of either placement is shorter) in {g['at_bound']} cases. "
                f"Bound check: of {g['bound_checked']} simulated schedules of the two placements that fit "
                f"their case's limit (the hand-made ones and auto's result for each placement), "
                f"{len(g['bound_violated'])} are shorter than their placement's bound"
                f"{' (' + '; '.join(g['bound_violated']) + ')' if g['bound_violated'] else ''} and "
                f"{g['bound_reached']} reach it. The cases where auto differs from the best one-copy built-in:",
                grid_table(result)]
    sw = result.get("sweep")
    if sw:
        out += [f"### Latency 0.5 at P={sw['P']}, M={sw['M']} under growing limits (zb-h1: {_f(sw['zb_h1'])})",
                sweep_table(sw)]
    st = result.get("search_time")
    if st:
        out += [f"### Search time, P={st['P']}, M={st['M']}: slowest {st['max_wall_s']:.2f} s wall (< 10 s: "
                f"{met(st['met'])}); load average after: {st['loadavg']}",
                [["costs", "limit", "placement", "wall s", "CPU s"]] +
                [[r["profile"], _f(r["limit"]), r["placement"], f"{r['wall_s']:.2f}", f"{r['cpu_s']:.2f}"]
                 for r in st["rows"]]]
    return out


def figures(result: Result, folder: str) -> list[tuple[str, str]]:
    """The limit sweep (bounds and auto against the limit) and auto's V schedule at the latency target."""
    sweep = result.get("sweep")
    if not sweep:
        return []
    fig = figure(6.4, 3.6)
    ax = fig.add_subplot()
    limits = [r["limit"] for r in sweep["rows"]]
    for key, label, style in (("linear_bound", "bound, one stage per rank", "--"), ("v_bound", "bound, V", ":"),
                              ("linear", "auto, one stage per rank", "-o"), ("v", "auto, V", "-s")):
        ax.plot(limits, [r[key] for r in sweep["rows"]], style, label=label, markersize=4)
    target = 0.97 * sweep["zb_h1"]
    ax.axhline(target, color="#c0392b", linewidth=1)
    ax.annotate(f"0.97 x zb-h1 = {target:.2f}", (limits[-1], target), xytext=(0, 3), textcoords="offset points",
                ha="right", fontsize=8, color="#c0392b")
    ax.set_xlabel(f"memory limit per rank (stage-microbatches of a {sweep['P']}-part split)", fontsize=8.5)
    ax.set_ylabel("makespan (simulated)", fontsize=8.5)
    ax.set_title(f"latency 0.5, P={sweep['P']}, M={sweep['M']}: the bounds and auto against the limit", fontsize=9.5)
    ax.legend(fontsize=7.5)
    fig.savefig(os.path.join(folder, "auto_limit_sweep.png"))
    v_gantt(sweep["P"], sweep["M"], os.path.join(folder, "auto_v_bound.png"))
    return [("auto_limit_sweep.png", "The bounds and auto against the memory limit"),
            ("auto_v_bound.png", "auto's V schedule at the latency target")]


def v_gantt(ranks: int, mbs: int, path: str) -> None:
    """auto's V schedule at the latency target (zbv, at the bound), with its live activations."""
    from duplexpipe.viz import plot_timeline

    cost = cost_for(build_schedule("zbv", ranks, mbs), LATENCY)
    result = search(ranks, mbs, cost=cost, memory_limit=ranks, placement="v")
    title = (f"auto (V, {result.winner.label}) at P={ranks}, M={mbs}, latency 0.5, limit {ranks}: "
             f"{result.winner.makespan:g} = the bound {result.bound:g}")
    plot_timeline(simulate(result.schedule, cost), path, activations=True, title=title)


PART = Part("auto_search", "Automatic schedule search (simulated)", AutoSearchConfig(), QUICK, run, report, figures,
            block="auto")

if __name__ == "__main__":
    raise SystemExit(runner.main(only=PART.name))
