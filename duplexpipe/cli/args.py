"""Command-line values made into checked objects: schedules, costs, generator options, views and paths."""

from __future__ import annotations

import argparse
import math
import os
from collections import Counter
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, NoReturn, Sequence

from duplexpipe.cli import help as docs
from duplexpipe.errors import ScheduleError
from duplexpipe.schedules.ir import Schedule, json_header, load_json, load_torch_csv, read_json

if TYPE_CHECKING:
    from duplexpipe.schedules.simulate import CostModel
    from duplexpipe.schedules.timeline import Timeline

MAX_WORK = 500_000
"""Largest built-in schedule the command line builds: P x M (x chunks when --opt chunks is given). Time
and memory grow linearly with it (measured: ZB-V at P=500 M=1000 took 41 s of CPU and 2.1 GB), so
P=10000 M=8 takes seconds, and a plan hundreds of times larger is refused at once instead of running
out of memory."""
MAX_PLOT_RANKS = 100_000
"""Most ranks a plot draws (time and memory grow with the rows even when they are empty: 100,000 ranks of
1F1B took 22 s of CPU); --ranks-shown picks fewer."""
COSTS_PER = ("model-part", "stage")
"""The two cost conventions: F/B/W per 1/P of the model (stages scaled, CostModel.stage_scale) or per stage."""
VIZ_HINT = "pip install 'duplexpipe[viz]'"


class CliError(Exception):
    """Bad input from the command line: printed as one line, exit code 2."""


def positive(kind: str) -> Any:
    """An argparse type: an integer >= 1, the error naming `kind`."""
    def convert(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{kind} must be an integer, got {text!r}") from None
        if value < 1:
            raise argparse.ArgumentTypeError(f"{kind} must be >= 1, got {value}")
        return value

    return convert


def parse_value(text: str) -> Any:
    """A generator option's value: an int, a float, true/false, else the text itself."""
    for convert in (int, float):
        try:
            return convert(text)
        except ValueError:
            pass
    lowered = text.strip().lower()
    if lowered in ("true", "false"):
        return lowered == "true"
    return text


def parse_opts(items: Sequence[str]) -> dict[str, Any]:
    """`--opt KEY=VALUE` items as keyword options (each key once, a Python name)."""
    options: dict[str, Any] = {}
    for item in items:
        key, sep, raw = (part.strip() for part in item.partition("="))
        if not sep or not key.isidentifier():
            raise CliError(f"bad --opt {item!r}: expected KEY=VALUE, e.g. --opt chunks=4")
        if key in options:
            raise CliError(f"--opt {key} is given twice")
        if key == "cost":
            raise CliError("give a generator's cost model with --cost and --stage-cost, not --opt cost=")
        options[key] = parse_value(raw)
    return options


def parse_ranks(text: str) -> tuple[int, ...]:
    """An argparse type: `0-7,60-63` -> (0, 1, ..., 7, 60, ..., 63), each rank once."""
    shown: list[int] = []
    for item in (p.strip() for p in text.split(",")):
        lo, dash, hi = item.partition("-")
        try:
            first, last = int(lo), int(hi if dash else lo)
        except ValueError:
            raise argparse.ArgumentTypeError(f"bad rank list {text!r}: expected ranks and ranges like "
                                             "0-7,60-63") from None
        if first < 0 or last < first:
            raise argparse.ArgumentTypeError(f"bad rank range {item!r} in {text!r}: expected LOW-HIGH with "
                                             "0 <= LOW <= HIGH")
        shown += range(first, last + 1)
    repeated = sorted(r for r, n in Counter(shown).items() if n > 1)
    if repeated:
        raise argparse.ArgumentTypeError(f"rank list {text!r} names rank(s) {repeated} more than once")
    return tuple(shown)


def parse_window(text: str) -> tuple[float | None, float | None]:
    """An argparse type: `START:END` on the plot's time axis, either end may be left out (`:50`, `100:`)."""
    lo, sep, hi = text.partition(":")
    try:
        if not sep:
            raise ValueError
        ends = tuple(float(p) if p.strip() else None for p in (lo, hi))
    except ValueError:
        raise argparse.ArgumentTypeError(f"bad window {text!r}: expected START:END in the units of the plot's "
                                         "time axis, e.g. 100:250, 100: or :250") from None
    start, end = ends
    if any(v is not None and not math.isfinite(v) for v in ends):
        raise argparse.ArgumentTypeError(f"bad window {text!r}: its ends must be finite numbers")
    if start is not None and end is not None and not start < end:
        raise argparse.ArgumentTypeError(f"bad window {text!r}: START must be less than END")
    return start, end


def check_output(path: str, option: str, *, figure: bool = False) -> None:
    """Fail now (before any expensive work) if `path` cannot be written, or drawn without matplotlib."""
    if figure:
        suffix = os.path.splitext(path)[1].lower()
        if suffix not in (".png", ".svg", ".pdf"):
            raise CliError(f"{option} {path}: unsupported figure format {suffix or '(none)'!r}; "
                           "use .png, .svg or .pdf")
    if os.path.isdir(path):
        raise CliError(f"{option} {path}: is a directory; give a file name")
    parent = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(parent):
        what = "is not a directory" if os.path.exists(parent) else "does not exist"
        raise CliError(f"{option} {path}: {parent} {what}")
    if not os.access(parent, os.W_OK) or (os.path.exists(path) and not os.access(path, os.W_OK)):
        raise CliError(f"{option} {path}: permission denied")
    if figure:
        require_matplotlib(option)


def require_matplotlib(option: str) -> None:
    """CliError with the install hint when matplotlib cannot be imported."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise CliError(f"{option} needs matplotlib, which is not installed: {VIZ_HINT}") from None


def has_key(text: str, key: str) -> bool:
    """True when the cost string `text` sets `key` (case-insensitive)."""
    return any(item.partition("=")[0].strip().lower() == key for item in text.split(","))


def cost_model(text: str, stage_items: Sequence[str], costs_per: str | None) -> CostModel:
    """The CostModel of `--cost TEXT`, `--stage-cost` items and `--costs-per` (default model-part)."""
    from dataclasses import replace

    from duplexpipe.schedules.simulate import CostModel

    try:
        base = CostModel.parse(text) if text else CostModel()
    except ValueError as exc:
        raise CliError(f"bad --cost: {exc}") from None
    scale = base.stage_scale if costs_per is None and has_key(text, "stage_scale") else costs_per != "stage"
    if costs_per is not None and has_key(text, "stage_scale") and base.stage_scale != scale:
        raise CliError(f"--cost stage_scale={str(base.stage_scale).lower()} contradicts --costs-per {costs_per}; "
                       "give the convention once")
    try:
        return replace(base, stage_scale=scale, stage_costs=parse_stage_costs(stage_items, base))
    except ValueError as exc:
        raise CliError(f"bad --stage-cost: {exc}") from None


def parse_stage_costs(items: Sequence[str], base: CostModel) -> dict[int, tuple[float, float, float]]:
    """`--stage-cost STAGES:F=..,B=..,W=..` items (STAGES: `3` or `0-3`) as CostModel.stage_costs; unset
    keys keep `base`'s F, B, W; a stage may be named once."""
    table: dict[int, tuple[float, float, float]] = {}
    for item in items:
        where, sep, spec = item.partition(":")
        lo, dash, hi = where.strip().partition("-")
        try:
            if not sep:
                raise ValueError
            stages = range(int(lo), int(hi if dash else lo) + 1)
        except ValueError:
            raise CliError(f"bad --stage-cost {item!r}: expected STAGES:KEY=VALUE,..., e.g. 3:F=1.5,B=3 or "
                           "0-3:F=2") from None
        values = {"f": base.f, "b": base.b, "w": base.w}
        for part in (p.strip() for p in spec.split(",") if p.strip()):
            key, eq, raw = (s.strip() for s in part.partition("="))
            if not eq or key.lower() not in values:
                raise CliError(f"bad --stage-cost {item!r}: {part!r} is not F=, B= or W= with a number")
            try:
                values[key.lower()] = float(raw)
            except ValueError:
                raise CliError(f"bad --stage-cost {item!r}: {key} needs a number, got {raw!r}") from None
        if not stages or int(lo) < 0:
            raise CliError(f"bad --stage-cost {item!r}: expected stage numbers >= 0, low to high")
        for stage in stages:
            if stage in table:
                raise CliError(f"--stage-cost names stage {stage} more than once")
            table[stage] = (values["f"], values["b"], values["w"])
    return table


def check_size(name: str, ranks: int, microbatches: int, options: dict[str, Any]) -> None:
    """Refuse, before building or reading its actions, a schedule above MAX_WORK."""
    chunks = options.get("chunks")
    factor = chunks if isinstance(chunks, (int, float)) and not isinstance(chunks, bool) and chunks > 1 else 1
    work = ranks * microbatches * factor  # a float chunks (1e8) counts too: the generator refuses it later
    if work > MAX_WORK:
        what = f"P x M{' x chunks' if factor > 1 else ''} = {work:,.0f}"
        raise CliError(f"{name} with P={ranks} M={microbatches}: {what} is over the command line's limit of "
                       f"{MAX_WORK:,} (time and memory grow with it, about 4 KB per unit); use fewer ranks or "
                       "microbatches, or the Python API")




def build_builtin(name: str, ranks: int | None, microbatches: int | None, options: dict[str, Any],
                  cost: CostModel | None) -> Schedule:
    """A built-in schedule; `cost` goes to generators whose registry entry takes a "cost" option."""
    from duplexpipe.schedules import registry
    from duplexpipe.schedules.compare import with_cost

    if ranks is None or microbatches is None:
        raise CliError(f"schedule {name!r} needs --ranks and --microbatches")
    check_size(name, ranks, microbatches, options)
    try:
        return registry.build(name, ranks, microbatches, **with_cost(name, options, cost))
    except ValueError as exc:
        raise CliError(str(exc)) from None


def load_schedule(spec: str, ranks: int | None, microbatches: int | None, options: dict[str, Any] | None = None,
                  cost: CostModel | None = None) -> Schedule:
    """A built-in schedule by name (needs P and M), or a JSON / torch CSV file (whose P and M must agree
    with -p/-m when given)."""
    from duplexpipe.schedules import registry

    if spec in registry.names():
        return build_builtin(spec, ranks, microbatches, dict(options or {}), cost)
    if not (os.path.exists(spec) or spec.endswith((".json", ".csv"))):
        raise CliError(f"unknown schedule {spec!r}: expected one of {', '.join(registry.names())} "
                       "or a .json/.csv file")
    if options:
        raise CliError(f"--opt applies to built-in schedules; {spec} is a file")
    if os.path.isdir(spec):
        raise CliError(f"{spec} is a directory, not a schedule file")
    if not spec.endswith(".csv"):  # P x M from the header, before the actions are read
        stated_ranks, stated_microbatches = json_header(spec)
        if stated_ranks is not None and stated_microbatches is not None:
            check_size(spec, stated_ranks, stated_microbatches, {})
    schedule = load_torch_csv(spec, num_microbatches=microbatches) if spec.endswith(".csv") else load_json(spec)
    check_size(spec, schedule.num_ranks, schedule.num_microbatches, {})
    for flag, given, actual in (("-p", ranks, schedule.num_ranks), ("-m", microbatches, schedule.num_microbatches)):
        if given is not None and given != actual:
            raise CliError(f"{spec} holds {actual} {'ranks' if flag == '-p' else 'microbatches'}, but {flag} "
                           f"{given} was given")
    return schedule


def load_timeline(path: str) -> Timeline:
    """A timeline file (`Timeline.to_dict()` JSON, as `duplexpipe train --out-dir` writes timeline.json)."""
    from duplexpipe.schedules.timeline import Timeline

    if os.path.isdir(path):
        raise CliError(f"{path} is a directory, not a timeline file")
    from duplexpipe.schedules.timeline import MAX_TIMELINE_FILE_BYTES

    try:
        data = read_json(path, MAX_TIMELINE_FILE_BYTES, "timeline file")
    except ScheduleError as exc:
        raise CliError(str(exc)) from None
    if isinstance(data, dict) and data.get("format") == "duplexpipe-schedule":
        raise CliError(f"{path} is a schedule, not a timeline: draw it with "
                       f"'duplexpipe simulate {path} --plot OUT.png'")
    if not isinstance(data, dict) or "events" not in data:
        raise CliError(f"{path}: not a timeline (expected a JSON object with 'events', as "
                       "'duplexpipe train --out-dir' writes to timeline.json)")
    try:
        timeline = Timeline.from_dict(data)
    except ScheduleError as exc:
        raise CliError(f"{path}: {exc}") from None
    if not 1 <= timeline.num_ranks <= MAX_PLOT_RANKS:
        raise CliError(f"{path}: 'ranks' must be 1..{MAX_PLOT_RANKS:,}, got {timeline.num_ranks}")
    if not timeline.events:
        raise CliError(f"{path}: the timeline has no events to draw")
    stray = sorted({e.rank for e in timeline.events if not 0 <= e.rank < timeline.num_ranks})
    if stray:
        raise CliError(f"{path}: events on ranks {stray}, outside 0..{timeline.num_ranks - 1}")
    bad = next((e for e in timeline.events if not (math.isfinite(e.start) and e.start <= e.end)), None)
    if bad is not None or not math.isfinite(timeline.makespan):
        what = f"{bad.action} on rank {bad.rank} runs from {bad.start} to {bad.end}" if bad else "the times overflow"
        raise CliError(f"{path}: {what}; expected finite times, each event ending at or after its start")
    return timeline


class Parser(argparse.ArgumentParser):
    """argparse with one-line errors (exit 2) instead of usage dumps, and an epilog that may be made only when the help
    is shown (`lazy_epilog`: one that imports what a command's parsing should not)."""

    def __init__(self, *args: Any, lazy_epilog: Callable[[], str] | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.lazy_epilog = lazy_epilog

    def format_help(self) -> str:
        if self.lazy_epilog is not None:
            self.epilog, self.lazy_epilog = self.lazy_epilog(), None
        return super().format_help()

    def error(self, message: str) -> NoReturn:
        raise CliError(f"{message} (see '{self.prog} --help')")


def command(sub: Any, name: str, summary: str) -> argparse.ArgumentParser:
    """A subcommand with its description, examples and exit codes from `cli_help`."""
    return sub.add_parser(name, help=summary, description=docs.DESCRIPTIONS[name], epilog=docs.EPILOGS[name],
                          formatter_class=argparse.RawDescriptionHelpFormatter)


def add_schedule(p: argparse.ArgumentParser, many: bool = False) -> None:
    if many:
        p.add_argument("schedules", nargs="*", metavar="NAME|FILE", help=docs.SCHEDULES_ARG)
    else:
        p.add_argument("schedule", metavar="NAME|FILE", help=docs.SCHEDULE_ARG)
    p.add_argument("-p", "--ranks", type=positive("ranks"), help="pipeline ranks P (built-in schedules)")
    p.add_argument("-m", "--microbatches", type=positive("microbatches"),
                   help="microbatches M per step (built-in schedules)")
    p.add_argument("--opt", action="append", default=[], metavar="KEY=VALUE",
                   help="a generator option, repeatable, e.g. --opt chunks=4 for interleaved-1f1b (values: "
                        "int, float, true/false or text; 'duplexpipe schedules' lists each one's options)")


def add_cost(p: argparse.ArgumentParser, planning_only: bool = False) -> None:
    group = p.add_argument_group("costs" + (" (only for generators that plan by cost)" if planning_only else ""),
                                 None if planning_only else docs.COSTS)
    group.add_argument("--cost", default="", metavar="SPEC",
                       help="F=1,B=2,W=1 (defaults), FB=3 (an F&B pair; default F+B), latency=0, bandwidth=1e9 "
                            "(bytes per unit time), bytes=4e6 (one message)")
    group.add_argument("--stage-cost", action="append", default=[], metavar="STAGES:SPEC",
                       help="F/B/W of some stages, repeatable: 3:F=1.5,B=3 or 0-3:F=2 (unset keys keep --cost's)")
    group.add_argument("--costs-per", choices=COSTS_PER, default=None,
                       help="model-part (default): costs are the times of 1/P of the model; stage: of one stage")


def add_zero3(p: argparse.ArgumentParser) -> None:
    """--zero-stage, --reshard-window and --unshard-lookahead: lower the schedule with ZeRO-3's actions."""
    group = p.add_argument_group("ZeRO-3 in the schedule (UNSHARD, RESHARD, REDUCE_GRAD per stage)")
    group.add_argument("--zero-stage", type=int, choices=(0, 1, 2, 3), default=0,
                       help="3: add ZeRO-3's actions to the schedule (0-2 leave it as it is)")
    group.add_argument("--reshard-window", type=positive("reshard window"), metavar="N",
                       help="stages a rank keeps unsharded at once (default: all of a rank's stages, one "
                            "all-gather per stage per step)")
    group.add_argument("--unshard-lookahead", type=int, default=1, metavar="L",
                       help="issue each UNSHARD L compute actions before its first use (default 1)")


def with_zero3(schedule: Schedule, args: argparse.Namespace) -> Schedule:
    """`schedule` with ZeRO-3's actions when --zero-stage 3 asks for them (CliError for a window without it)."""
    from duplexpipe.schedules.shard import add_unshard_reshard

    if args.zero_stage != 3:
        if args.reshard_window is not None:
            raise CliError("--reshard-window needs --zero-stage 3")
        return schedule
    if schedule.has_fsdp:
        raise CliError(f"{schedule.name} already holds UNSHARD/RESHARD/REDUCE_GRAD actions: leave out --zero-stage")
    window = args.reshard_window or max(len(schedule.stages_of_rank(r)) for r in range(schedule.num_ranks))
    try:
        return add_unshard_reshard(schedule, window, args.unshard_lookahead)
    except ValueError as exc:
        raise CliError(str(exc)) from None


def add_view(p: argparse.ArgumentParser, what: str) -> None:
    p.add_argument("--ranks-shown", type=parse_ranks, metavar="RANKS",
                   help=f"draw only these ranks{what}, e.g. 0-7,60-63")
    p.add_argument("--window", type=parse_window, metavar="START:END",
                   help=f"draw only this stretch of the time axis{what}, in its units (e.g. 0:300, 1200:)")


def schedule_of(args: argparse.Namespace) -> Schedule:
    """The schedule a show/verify/simulate/export command names, with its options and cost model (and ZeRO-3's
    actions where the command takes --zero-stage)."""
    schedule = load_schedule(args.schedule, args.ranks, args.microbatches, parse_opts(args.opt), cost_of(args))
    return with_zero3(schedule, args) if hasattr(args, "zero_stage") else schedule


def cost_of(args: argparse.Namespace) -> Any:
    return cost_model(args.cost, args.stage_cost, args.costs_per)


def check_view_args(args: argparse.Namespace, schedule: Schedule | None, drawing: bool) -> None:
    if not drawing and (args.ranks_shown is not None or args.window is not None):
        raise CliError("--ranks-shown and --window shape the plot: they need --plot")
    ranks = schedule.num_ranks if schedule is not None else args.ranks or 0
    if drawing and args.ranks_shown is None and ranks > MAX_PLOT_RANKS:
        raise CliError(f"--plot draws at most {MAX_PLOT_RANKS:,} ranks, the schedule has {ranks:,}: pick some "
                       "with --ranks-shown")
    if ranks and args.ranks_shown and max(args.ranks_shown) >= ranks:
        raise CliError(f"--ranks-shown names rank {max(args.ranks_shown)}, but the schedule has ranks 0..{ranks - 1}")


def viz(name: str) -> Any:
    """A drawing function of duplexpipe.viz, or CliError with the install hint if matplotlib is missing."""
    require_matplotlib(f"drawing ({name})")
    import duplexpipe.viz as viz

    return getattr(viz, name)
