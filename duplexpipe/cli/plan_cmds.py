"""The `duplexpipe plan` and `duplexpipe profile` commands, and the byte memory shown by simulate/compare."""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Sequence
from typing import Any

from duplexpipe.cli.args import command
from duplexpipe.planner.profile import load_profile, save_profile
from duplexpipe.sizes import format_bytes, parse_bytes

MAX_EVICT_BYTES = 4 * 2**30
"""Most bytes `profile --evict` writes before each timed pass (4 GiB): caches hold megabytes, so a larger figure
evicts nothing more and only takes the memory."""


def add_parsers(sub: Any) -> None:
    """Add `plan` and `profile` to the `duplexpipe` subcommands (no torch needed to parse them)."""
    pl = command(sub, "plan", "choose schedule, microbatches, ZeRO stage and compression under a memory cap, from "
                 "a profile")
    pl.add_argument("--profile", required=True, metavar="FILE", help="a profile written by 'duplexpipe profile'")
    pl.add_argument("-p", "--ranks", type=_integer("ranks"), default=None,
                    help="pipeline ranks P (required without --world; with it, fixes P)")
    pl.add_argument("--dp", type=_integer("dp"), default=None,
                    help="data-parallel replicas D (default 1; with --world, fixes D)")
    _add_mesh_options(pl)
    pl.add_argument("--batch", type=_integer("batch"), required=True, help="global batch per step, in samples")
    pl.add_argument("--memory", "--memory-limit", dest="memory", type=_size("memory"), required=True, metavar="SIZE",
                    help="cap per rank, e.g. 40GiB, 512MiB, 8e9")
    pl.add_argument("--bandwidth", type=_size("bandwidth"), default=None, metavar="BYTES",
                    help="bytes per second between data-parallel replicas, and between pipeline ranks unless "
                    "--p2p-bandwidth is given, e.g. 25GB (default: communication is free)")
    pl.add_argument("--latency", type=_seconds("latency"), default=0.0, help="seconds per message (default 0)")
    pl.add_argument("--p2p-bandwidth", type=_size("p2p-bandwidth"), default=None, metavar="BYTES",
                    help="bytes per second between pipeline neighbours (default: --bandwidth)")
    pl.add_argument("--schedules", type=_names, default=None, metavar="A,B",
                    help="registry names to consider (default: all, auto included)")
    pl.add_argument("--microbatches", type=_integers("microbatches"), default=None, metavar="M1,M2",
                    help="microbatch counts to try (default: divisors of batch/D from P to 8P)")
    pl.add_argument("--zero", type=_integers("zero", minimum=0), default=None, metavar="S1,S2",
                    help="ZeRO stages to try (default: every stage the trainer has, 0,1,2,3, ZeRO-3 where ZeRO-2 is "
                    "over the cap; with --dp 1 they are one plan, shown once)")
    pl.add_argument("--reshard-windows", type=_windows, default=(1, None), metavar="W1,W2",
                    help="ZeRO-3 residency windows to try, in stages kept unsharded at once, 'all' for all of a "
                    "rank's stages (default 1,all; a window below all where all is over the cap)")
    pl.add_argument("--activation-checkpointing", type=_policies, default="auto", metavar="POLICY",
                    help="checkpointing policies to try on every stage: off, selective (a profile's measured "
                    "selective figures), full, a comma list of them, or auto (default: all three, each heavier one "
                    "where the lighter is over the cap)")
    pl.add_argument("--host-bandwidth", type=_size("host-bandwidth"), default=None, metavar="BYTES",
                    help="bytes per second of copies between a rank's device and host memory, e.g. 20GB: activation "
                    "offload is planned with it (default: unknown, offload is never planned)")
    pl.add_argument("--compression", type=_names, default=None, metavar="A,B|all",
                    help="gradient compressions allowed, under the trainer's names (none, bf16, fp16, int8, powersgd, "
                    "powersgd(rank=1), dgc; default all); only pairs with a ZeRO stage the trainer accepts are planned")
    pl.add_argument("--optimizer-factor", type=float, default=2.0,
                    help="optimizer-state bytes per parameter byte (default 2: AdamW)")
    pl.add_argument("--cores", type=_integer("cores"), default=None,
                    help="cores shared by the P x T processes of one replica, with --world by all of them "
                    "(processor sharing; default: a calibrated profile's cores and the share of them its runs got, "
                    "else a device per rank)")
    pl.add_argument("--top", type=_integer("top"), default=None, help="print only the first N rows")
    pl.add_argument("--json", action="store_true", help="print the result as JSON")
    pl.add_argument("--plot", metavar="FILE", help="write the step-time vs peak-memory Pareto figure")
    _add_profile_parser(sub)


def _add_profile_parser(sub: Any) -> None:
    """`profile`: the task, its parts and how they are measured (here, or calibrated on local ranks)."""
    pr = command(sub, "profile", "measure a model's parts (time, activation and message bytes) into a profile for "
                 "'duplexpipe plan'")
    pr.add_argument("--task", default=None, help="'file.py:function' or 'module:function' returning a TrainTask, or "
                    "a bundled task: 'gpt' (the default) or 'hf' (a Hugging Face model directory: --task-option "
                    "model=DIR --task-option data=FILE)")
    pr.add_argument("--task-option", action="append", default=[], metavar="KEY=VALUE",
                    help="keyword argument for the task function (repeatable)")
    pr.add_argument("--parts", type=_integer("parts"), required=True,
                    help="model parts to measure (the most any considered schedule needs, e.g. 2P for ZB-V)")
    pr.add_argument("--microbatch", type=_integer("microbatch"), default=None,
                    help="samples in the profiled microbatch (default: the training default, batch 32 over 8 "
                    "microbatches = 4)")
    pr.add_argument("--repeats", type=_integer("repeats"), default=3,
                    help="measured runs per part (the fastest counts)")
    pr.add_argument("--evict", type=_size("--evict", MAX_EVICT_BYTES), default=None, metavar="SIZE",
                    help="write SIZE bytes before each timed pass, so caches are cold as in a pipeline (e.g. the "
                    "activations one microbatch keeps through the model; default 0: warm; with --calibrate, what "
                    "schedule='auto' takes: the bytes one microbatch keeps, at least twice the L2 cache)")
    pr.add_argument("--balance", choices=("uniform", "params", "time"), default="uniform",
                    help="how to split the layers into parts (default uniform)")
    pr.add_argument("--threads", type=_integer("threads"), default=1,
                    help="torch CPU threads while measuring (default 1: what each rank of a local run gets "
                    "when the ranks fill the cores; more threads on a shared machine make timings erratic)")
    pr.add_argument("--calibrate", action="store_true",
                    help="also train the parts on --ranks local processes on calibration schedules (as "
                    "schedule='auto' does) and store the runtime's work per action, message and step, the compute "
                    "scale inside a running pipeline, the runs' wall times and the stage-to-stage link in the profile: "
                    "'plan' then predicts what a run measures, not the parts' compute alone")
    pr.add_argument("--ranks", type=_integer("ranks"), default=None, metavar="P",
                    help="pipeline ranks of the calibration (default 2; --calibrate only)")
    pr.add_argument("--batch", type=_integer("batch"), default=None,
                    help="samples per step of the calibration (default 32; --calibrate only): the profile is taken at "
                    "its largest candidate microbatch")
    pr.add_argument("--budget", type=_seconds("budget"), default=None, metavar="SECONDS",
                    help="seconds of measured calibration steps (default 3; --calibrate only)")
    pr.add_argument("-o", "--output", required=True, metavar="FILE", help="where to write the profile (JSON)")
    pr.add_argument("--json", action="store_true", help="print the profile as JSON")


def _add_mesh_options(parser: argparse.ArgumentParser) -> None:
    """`plan`'s options of the world size and tensor parallelism."""
    parser.add_argument("--world", type=_integer("world"), default=None,
                    help="processes in all: compare every P x D x T = WORLD (-p, --dp, --tp fix a factor)")
    parser.add_argument("--tp", type=_integer("tp"), default=None,
                    help="tensor-parallel degree T inside each stage (default 1; with --world, fixes T); T > 1 "
                    "needs a profile taken with the model's TP plan")
    parser.add_argument("--tp-bandwidth", type=_size("tp-bandwidth"), default=None, metavar="BYTES",
                    help="bytes per second each way between the ranks of a TP group (default 300GB: NVLink 3 "
                    "inside a node)")
    parser.add_argument("--tp-latency", type=_seconds("tp-latency"), default=0.0,
                    help="seconds per message of a TP collective (default 0)")
    parser.add_argument("--sequence-parallel", action="store_true",
                    help="with T > 1: activations and stage-to-stage messages hold 1/T of the sequence")


def add_profile_option(parser: argparse.ArgumentParser) -> None:
    """`--profile FILE` for simulate and compare: also show memory per rank in bytes."""
    parser.add_argument("--profile", metavar="FILE", default=None,
                        help="a profile ('duplexpipe profile'): also show each rank's memory in bytes")


def _machine(profile: Any, args: argparse.Namespace, cores: float | None) -> str:
    """What the step time assumes about the machine, in a few words (`cores`: the plan's, given or calibrated)."""
    where = f"{cores:.3g} cores shared by the {'world' if args.world else 'ranks'}" if cores else \
        "a device per rank"
    return f"{where}, {_overhead(profile) or 'no runtime overhead measured'}"


def _overhead(profile: Any) -> str:
    """The runtime overhead a calibrated profile holds, in a few words ("" for none)."""
    over = profile.overhead
    if over is None:
        return ""
    return (f"runtime overhead {over.action_s * 1e6:.0f} us per action, {over.message_s * 1e6:.0f} us per message, "
            f"{over.step_s * 1e3:.3g} ms per step"
            + (f", compute x {over.compute_scale:.3g} in the pipeline" if over.compute_scale != 1.0 else "")
            + (f", wall time x {over.wall_scale:.3g}" if abs(over.wall_scale - 1.0) >= 5e-3 else ""))


UNCALIBRATED = ("warning: this profile holds no runtime overhead: every step time below is the parts' compute alone. "
                "On small models the runtime's own work (per action, message and step) can dominate, make the "
                "predictions several times low and change their order; measure it with 'duplexpipe profile "
                "--calibrate --ranks P --batch B' (as schedule='auto' does)")
"""What `plan` prints first (to stderr) for a profile without runtime overhead."""


def _integer(name: str, minimum: int = 1) -> Any:
    def convert(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{name} must be an integer, got {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"{name} must be >= {minimum}, got {value}")
        return value
    return convert


def _integers(name: str, minimum: int = 1) -> Any:
    one = _integer(name, minimum)
    return lambda text: tuple(one(item.strip()) for item in text.split(",") if item.strip())


def _windows(text: str) -> tuple[int | None, ...]:
    one = _integer("reshard-windows")
    return tuple(None if item.strip() == "all" else one(item.strip()) for item in text.split(",") if item.strip())


def _policies(text: str) -> tuple[str, ...]:
    from duplexpipe.planner.candidates import CHECKPOINTING

    names = _names(text)
    if names == ("auto",):
        return CHECKPOINTING
    if not names or any(name not in CHECKPOINTING for name in names):
        raise argparse.ArgumentTypeError(f"activation-checkpointing must be {', '.join(CHECKPOINTING)}, a comma list "
                                         f"of them, or auto; got {text!r}")
    return names


def _names(text: str) -> tuple[str, ...]:
    return tuple(item.strip() for item in text.split(",") if item.strip())


def _size(name: str, most: int | None = None) -> Any:
    def convert(text: str) -> int:
        try:
            value = parse_bytes(text)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None
        if most is not None and value > most:
            raise argparse.ArgumentTypeError(f"{text} is over the limit of {most // 2**30} GiB ({most:,} bytes)")
        return value
    return convert


def _seconds(name: str) -> Any:
    def convert(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{name} must be a number of seconds, got {text!r}") from None
        if not 0 <= value < math.inf:
            raise argparse.ArgumentTypeError(f"{name} must be >= 0 seconds, got {text!r}")
        return value
    return convert


def cmd_plan(args: argparse.Namespace) -> int:
    """`duplexpipe plan`."""
    from duplexpipe.planner.calibrate import with_calibration
    from duplexpipe.planner.dp_comm import COMPRESSIONS, Link
    from duplexpipe.planner.host_offload import offload_label
    from duplexpipe.planner.plan import PlanConfig, plan
    from duplexpipe.planner.tp_comm import DEFAULT_TP_BANDWIDTH
    from duplexpipe.planner.world import factorisations, plan_world

    if args.ranks is None and args.world is None:
        raise ValueError("plan needs -p/--ranks P (one mesh) or --world N (every P x D x T = N)")
    if args.world is not None:
        factorisations(args.world, pp=args.ranks, dp=args.dp, tp=args.tp)  # a world that does not factor: exit 2
    profile = load_profile(args.profile)
    p2p_bw = args.p2p_bandwidth or args.bandwidth
    compressions = tuple(COMPRESSIONS) if args.compression == ("all",) else args.compression
    config = PlanConfig(ranks=args.ranks or 1, batch=args.batch, memory=args.memory, dp=args.dp or 1,
                        schedules=args.schedules, microbatches=args.microbatches, zero_stages=args.zero,
                        compressions=compressions,
                        dp_link=Link(float(args.bandwidth or math.inf), args.latency),
                        p2p_link=Link(float(p2p_bw or math.inf), args.latency),
                        optimizer_factor=args.optimizer_factor, cores=args.cores, tp=args.tp or 1,
                        tp_link=Link(float(args.tp_bandwidth or DEFAULT_TP_BANDWIDTH), args.tp_latency),
                        sequence_parallel=args.sequence_parallel, reshard_windows=args.reshard_windows,
                        checkpointing=args.activation_checkpointing,
                        host_link=Link(float(args.host_bandwidth)) if args.host_bandwidth else None)
    given = {"p2p_link": p2p_bw is not None or bool(args.latency),
             "tp_link": args.tp_bandwidth is not None or bool(args.tp_latency),
             "host_link": args.host_bandwidth is not None}  # the user's links stand
    profile, config, measured = with_calibration(profile, config, [k for k, mine in given.items() if not mine])
    if args.world is not None:
        result = plan_world(profile, config, args.world, pp=args.ranks, dp=args.dp, tp=args.tp)
    else:
        result = plan(profile, config)
    if profile.overhead is None and not args.json:
        print(UNCALIBRATED, file=sys.stderr)
    if args.plot:
        from duplexpipe.viz.pareto import plot_pareto

        plot_pareto(result, args.plot)
    if args.json:
        print(json.dumps(result.to_dict(), indent=1))
        return 0
    best, tp_link = result.best, result.config.tp_link
    mesh = f"world {args.world} (every P x D x T)" if args.world is not None else \
        f"P={args.ranks} x D={args.dp or 1} x T={args.tp or 1}"
    print(f"plan for {mesh}, batch {args.batch}, cap {format_bytes(args.memory)} per rank; "
          f"profile of {profile.num_parts} parts at microbatch {profile.microbatch_size}; "
          f"{_machine(profile, args, config.cores)}; "
          f"TP link {tp_link.bandwidth / 1e9:.3g} GB/s{', sequence parallel' if args.sequence_parallel else ''}"
          + (f"; {measured}" if measured else ""))
    print(result.table(args.top))
    print(f"best: {best.schedule} with M={best.microbatches}, ZeRO {best.zero_label}, compression {best.compression}, "
          f"activation checkpointing {best.checkpointing}, activation offload {offload_label(best.offload)}, "
          f"P={best.ranks} x D={best.dp} x T={best.tp}: step {best.step_s * 1e3:.4g} ms, peak "
          f"{format_bytes(best.peak_bytes)} per rank")
    print(f"decided by {result.decided}")
    if result.advice:
        print(result.advice)
    if args.plot:
        print(f"figure written to {args.plot}")
    return 0


def cmd_profile(args: argparse.Namespace) -> int:
    """`duplexpipe profile` (imports torch)."""
    import torch

    from duplexpipe.launch.profiling import ProfileRequest, profile_task
    from duplexpipe.launch.train_config import DEFAULT_TASK, TASK_ALIASES, TrainConfig
    from duplexpipe.launch.train_settings import parse_key_values

    calibration = {"ranks": args.ranks, "batch": args.batch, "budget_s": args.budget}
    if not args.calibrate and any(v is not None for v in calibration.values()):
        given = [f"--{k.removesuffix('_s')}" for k, v in calibration.items() if v is not None]
        raise ValueError(f"{', '.join(given)}: only with --calibrate (the calibration's ranks, batch and time)")
    torch.set_num_threads(args.threads)
    defaults = TrainConfig()
    spec = TASK_ALIASES.get(args.task, args.task) if args.task else DEFAULT_TASK
    rows = max(1, defaults.batch_size // (defaults.pipeline.num_microbatches or 1))
    request = ProfileRequest(spec, parse_key_values(args.task_option), args.parts, args.balance,
                             args.microbatch or rows, args.repeats, args.evict, args.calibrate,
                             **{k: v for k, v in calibration.items() if v is not None})
    if request.calibrate and request.batch < request.ranks:
        raise ValueError(f"--batch {request.batch}: the calibration runs at least --ranks {request.ranks} "
                         "microbatches of at least one sample")
    profile = profile_task(request)
    try:
        save_profile(profile, args.output)
    except OSError as exc:
        raise ValueError(f"cannot write {args.output}: {exc.strerror}") from None
    if args.json:
        print(json.dumps(profile.to_dict(), indent=1))
        return 0
    print(f"{'part':>4} {'F ms':>8} {'I ms':>8} {'W ms':>8} {'activations':>12} {'params':>10} {'message':>10}")
    for k, p in enumerate(profile.parts):
        print(f"{k:>4} {p.forward_s * 1e3:>8.3f} {p.backward_input_s * 1e3:>8.3f} {p.backward_weight_s * 1e3:>8.3f} "
              f"{format_bytes(p.activation_bytes):>12} {format_bytes(p.param_bytes):>10} "
              f"{format_bytes(p.output_bytes):>10}")
    if request.calibrate:
        measured = _overhead(profile) or "the calibration could not separate its terms: no runtime overhead stored"
        cores = (profile.meta.get("calibration_mesh") or {}).get("cores")
        shared = f" sharing {cores:g} cores (plan's default)" if cores else ""
        print(f"calibrated on {request.ranks} ranks{shared}, batch {request.batch}: {measured}")
    degrees = ", ".join(map(str, profile.tp_degrees)) if profile.tp_degrees else "none (the task has no TP plan)"
    print(f"microbatch {profile.microbatch_size} samples; tensor-parallel degrees the plan can shard: {degrees}; "
          f"profile written to {args.output}")
    return 0


def memory_lines(per_rank: Sequence[dict[str, Any]]) -> list[str]:
    """A text table of `profile_memory`'s rows."""
    lines = [f"{'rank':>4} {'params':>10} {'grads':>10} {'optimizer':>10} {'activations':>12} {'messages':>10} "
             f"{'peak':>10}"]
    for r in per_rank:
        lines.append(f"{r['rank']:>4} " + " ".join(
            f"{format_bytes(r[k]):>{w}}" for k, w in (("params", 10), ("gradients", 10), ("optimizer", 10),
                                                      ("activations", 12), ("messages", 10), ("peak", 10))))
    return lines


__all__ = ["add_parsers", "add_profile_option", "cmd_plan", "cmd_profile", "memory_lines"]
