"""MoE F&B overlap: how much of the expert all-to-all one F&B pair hides behind the other microbatch's compute.

Part 1, one pair: every rank (4, or 2 with `--ranks 2`) holds a stage of `layers` MoE blocks whose experts
are spread over all ranks (expert parallelism over the world). The backward of microbatch 0 and the forward
of microbatch 1 run (a) one after the other, each all-to-all waited for where it is issued, and (b)
interleaved at their comm points (`runtime.pieces.run_pair`, what `PipelineConfig(fb_overlap=True)` runs),
alternating (a) and (b). The comm time is what the pair's all-to-alls take timed alone (every rank arrived
before each is issued); the hidden fraction is (sequential - overlapped) / comm.
Part 2, a whole DualPipeV step (PP=2 x DP=2 with ep=2, 4 ranks) with fb_overlap on and off, alternating.

On CPU (gloo) the all-to-alls of small tensors are too fast and share the cores with compute, so an
emulated link sets their time: each completes no earlier than latency + bytes / bandwidth after every rank
joined it (`LinkModel`), with the bandwidth chosen so that the pair's comm is about its compute (`--comm-ratio`;
the compute is F then B less its comm). With 4 processes on 2 cores the ranks also share the cores, so the
overlapped pair is bounded by their summed CPU work too; `--ranks 2` gives each rank a core.
On CUDA (NCCL, `--backend nccl`) the all-to-alls are real and no link is emulated; with one GPU the ranks
share it ($DUPLEXPIPE_SHARE_GPU=1) and NCCL moves the tokens over its socket transport on loopback.

Usage: python benchmarks/moe_overlap.py [--backend gloo|nccl] [--ranks 4|2] [--reps N] [--steps N] [--out DIR]
[--quick]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch import nn  # noqa: E402

from benchmarks import harness  # noqa: E402
from duplexpipe.launch.processes import SHARE_GPU_ENV  # noqa: E402
from duplexpipe.moe import CausalSelfAttention, ExpertGroup, MoEBlock, MoELayer  # noqa: E402
from duplexpipe.runtime.pieces import (  # noqa: E402
    CommRecord,
    CommSlot,
    Driver,
    LinkModel,
    Posted,
    current_driver,
    forward_slot,
    run_pair,
)


@dataclass(frozen=True)
class MoEBenchConfig:
    """The workload and how long to measure."""

    tokens: int = 512
    """Tokens per microbatch per rank."""
    dim: int = 128
    hidden: int = 256
    """Each expert's hidden width."""
    experts: int = 8
    top_k: int = 2
    layers: int = 2
    """MoE blocks in the stage."""
    mixer: str = "attention"
    """Each block's mixer before its MoE layer: "attention" (causal self-attention, 4 heads, over sequences of
    `seq` tokens, as in an MoE transformer) or "linear" (one Linear: almost no compute besides the experts)."""
    seq: int = 128
    """Tokens per sequence (the attention mixer)."""
    reps: int = 9
    """Timed pairs per mode (after 2 untimed)."""
    steps: int = 6
    """Timed DualPipeV steps per mode (after 1 untimed); 0 skips part 2."""
    comm_ratio: float = 1.0
    """gloo: the emulated link makes the pair's comm this many times its compute."""
    link_latency_s: float = 0.0
    """gloo: the emulated link's latency per all-to-all (its bandwidth follows from comm_ratio)."""
    backend: str = "gloo"
    ranks: int = 4
    """Processes (the expert-parallel group of part 1); part 2 runs only with 4."""


def _model(cfg: MoEBenchConfig, device: torch.device, rank: int, world: int) -> nn.Module:
    torch.manual_seed(0)
    blocks = []
    for _ in range(cfg.layers):
        layer = MoELayer(cfg.dim, cfg.hidden, cfg.experts, cfg.top_k, shared_experts=1)
        blocks.append(MoEBlock(cfg.dim, layer, mixer=_mixer(cfg)))
    model = nn.Sequential(*blocks).to(device)
    for block in blocks:
        block.moe.shard_experts(ExpertGroup(None, rank, world))
    return model


def _mixer(cfg: MoEBenchConfig) -> nn.Module:
    return CausalSelfAttention(cfg.dim, 4) if cfg.mixer == "attention" else nn.Linear(cfg.dim, cfg.dim)


def _tokens(cfg: MoEBenchConfig, count: int, gen: torch.Generator | None = None) -> torch.Tensor:
    """`count` random tokens: [count / seq, seq, dim] for the attention mixer, else [count, dim]."""
    shape = (count // cfg.seq, cfg.seq, cfg.dim) if cfg.mixer == "attention" else (count, cfg.dim)
    return torch.randn(*shape, generator=gen)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class _Measuring(Driver):
    """Times each exchange alone: the device drained and every rank arrived before it is issued (so the link
    counts from the issue), waited for at once, and the device drained again before it counts as done (a
    baseline mode only; it serialises everything)."""

    def __init__(self, device: torch.device, link: LinkModel | None, log: list[CommRecord]) -> None:
        def wait(work: Any, what: str) -> None:
            work.wait()
            _sync(device)

        super().__init__(wait=wait, link=link, log=log)
        self.device = device

    def post(self, issue: Any, label: str, nbytes: int = 0) -> Posted:
        _sync(self.device)
        dist.barrier()
        posted = super().post(issue, label, nbytes)
        posted.joined.insert(0, posted.record.issued)  # every rank joined at the barrier, before the issue
        self.finish(posted)  # alone, like every exchange here (a later wait for it returns at once)
        return posted


def _pair(model: nn.Module, x: list[torch.Tensor], grad: torch.Tensor, base: Driver, device: torch.device,
          mode: str) -> tuple[float, float]:
    """One timed pair: B of microbatch 0 (its forward untimed) and F of microbatch 1; (its wall time, this
    process's CPU time meanwhile: compute and the collectives' own work, every thread)."""
    slot = CommSlot(Driver(link=base.link))
    with forward_slot(slot):
        y0 = model(x[0])
    _sync(device)
    dist.barrier()

    def backward() -> None:
        slot.driver = current_driver(base)
        torch.autograd.backward(y0, grad)

    def forward() -> None:
        with forward_slot(CommSlot(current_driver(base))):
            model(x[1])

    start, cpu = time.perf_counter(), time.process_time()
    if mode == "overlapped":
        run_pair(backward, forward, base, device, defer_first=True)
    else:
        backward()
        forward()
    _sync(device)
    return time.perf_counter() - start, time.process_time() - cpu


MODES = ("sequential", "overlapped", "measured")


def _pairs(cfg: MoEBenchConfig, rank: int, world: int, device: torch.device, link: LinkModel | None,
           reps: int) -> dict[str, list[float]]:
    """Pair times per mode (alternating), the comm time of each measured pair (its exchanges alone), and the
    CPU time of each pair run either way."""
    model = _model(cfg, device, rank, world)
    gen = torch.Generator().manual_seed(rank)
    x = [_tokens(cfg, cfg.tokens, gen).to(device) for _ in range(2)]
    grad = _tokens(cfg, cfg.tokens, gen).to(device)
    out: dict[str, list[float]] = {m: [] for m in (*MODES, "comm", "overlapped_cpu", "sequential_cpu")}
    plain = Driver(link=link)  # one driver, as a runtime keeps one: its pairs reuse its two threads
    for rep in range(reps + 2):
        for mode in MODES if rep % 2 == 0 else MODES[::-1]:
            log: list[CommRecord] = []
            plain.log = log
            base = _Measuring(device, link, log) if mode == "measured" else plain
            took, cpu = _pair(model, x, grad, base, device, mode)
            if rep >= 2:
                out[mode].append(took)
                if mode != "measured":
                    out[f"{mode}_cpu"].append(cpu)
                if mode == "measured":
                    out["comm"].append(sum(r.done - r.issued for r in log))
            model.zero_grad(set_to_none=True)
    return out


def _link(cfg: MoEBenchConfig, rank: int, world: int, device: torch.device) -> tuple[LinkModel | None, float]:
    """gloo: a link whose all-to-alls (their real transfer, then the link's time) take comm_ratio x the pair's
    compute (F then B less its exchanges timed alone), the bandwidth agreed as the slowest rank's: first from a
    probe without a link, then corrected twice by probes with it (the compute measured around the emulated
    transfers, as the timed pairs see it). nccl: None."""
    if cfg.backend == "nccl":
        return None, 0.0
    model = _model(cfg, device, rank, world)
    log: list[CommRecord] = []
    _pair(model, [_tokens(cfg, cfg.tokens).to(device)] * 2, _tokens(cfg, cfg.tokens).to(device),
          Driver(log=log), device, "sequential")
    nbytes = sum(r.nbytes for r in log)
    link: LinkModel | None = None
    compute = real = 0.0
    for _ in range(3):
        probe = _pairs(cfg, rank, world, device, link, 3)
        compute = statistics.median(t - c for t, c in zip(probe["sequential"], probe["comm"], strict=True))
        if link is None:
            real = statistics.median(probe["comm"])  # the link's time adds to the real transfers'
        wanted = max(cfg.comm_ratio * compute - real - cfg.link_latency_s * len(log), 1e-6)
        bandwidth = torch.tensor([nbytes / wanted], dtype=torch.float64)
        dist.all_reduce(bandwidth, op=dist.ReduceOp.MIN)
        link = LinkModel(cfg.link_latency_s, float(bandwidth.item()))
    return link, compute


def _step_times(cfg: MoEBenchConfig, device: torch.device, link: LinkModel | None) -> dict[str, list[float]]:
    """A DualPipeV step (PP=2 x DP=2, ep=2) with fb_overlap on and off, alternating."""
    from duplexpipe import Pipeline, PipelineConfig, make_mesh

    mesh = make_mesh(2, 2, device.type, ep=2)
    torch.manual_seed(0)
    blocks: list[nn.Module] = [
        MoEBlock(cfg.dim, MoELayer(cfg.dim, cfg.hidden, cfg.experts, cfg.top_k, shared_experts=1),
                 mixer=_mixer(cfg)) for _ in range(4 * cfg.layers)]
    pipes = {}
    for overlap in (False, True):
        config = PipelineConfig(schedule="dualpipev", num_microbatches=8, fb_overlap=overlap, link=link,
                                record_timeline=False)
        pipes[overlap] = Pipeline.from_layers([nn.Identity()] + blocks, nn.functional.mse_loss,
                                              lambda ps: torch.optim.SGD(ps, lr=1e-3), config, mesh=mesh,
                                              device=device)
    gen = torch.Generator().manual_seed(dist.get_rank())
    x = _tokens(cfg, 8 * cfg.tokens // 2, gen).to(device)
    out: dict[str, list[float]] = {"off": [], "on": []}
    for rep in range(cfg.steps + 1):
        for overlap in (False, True) if rep % 2 == 0 else (True, False):
            _sync(device)
            dist.barrier()
            start = time.perf_counter()
            pipes[overlap].step(x, x)
            _sync(device)
            if rep:
                out["on" if overlap else "off"].append(time.perf_counter() - start)
    return out


def worker(rank: int, world: int, cfg: MoEBenchConfig) -> dict[str, Any]:
    """One rank's samples of both parts."""
    device = torch.device("cuda", torch.cuda.current_device()) if cfg.backend == "nccl" else torch.device("cpu")
    link, compute = _link(cfg, rank, world, device)
    result: dict[str, Any] = {"pairs": _pairs(cfg, rank, world, device, link, cfg.reps),
                              "link": asdict(link) if link is not None else None, "probe_compute_s": compute,
                              "cores": len(os.sched_getaffinity(0))}
    if cfg.steps and world == 4:
        result["steps"] = _step_times(cfg, device, link)
    return result


def summary(results: list[dict[str, Any]]) -> dict[str, Any]:
    """Medians over the reps of the slowest rank per rep: the pair's time each way, its comm (the measured
    mode's exchanges, each timed alone), its compute (F then B less that comm), the ratio and the hidden
    fraction (sequential - overlapped) / comm. gloo: also the cores' bound on the overlapped pair (the ranks'
    summed CPU time over the cores, or the busiest rank's) and the most of the comm that bound lets hide."""
    def slowest(key: str, part: str = "pairs") -> list[float]:
        return [max(vals) for vals in zip(*(r[part][key] for r in results), strict=True)]

    seq, ovl, measured, comm = (statistics.median(slowest(k)) for k in ("sequential", "overlapped", "measured",
                                                                         "comm"))
    out = {"sequential_ms": seq * 1e3, "overlapped_ms": ovl * 1e3, "measured_ms": measured * 1e3,
           "comm_ms": comm * 1e3, "compute_ms": (seq - comm) * 1e3, "pair_ratio": ovl / seq,
           "hidden": (seq - ovl) / comm, "link": results[0]["link"]}
    if results[0]["link"] is not None and "overlapped_cpu" in results[0]["pairs"]:
        cores = min(results[0].get("cores", 1), len(results))
        cpus = list(zip(*(r["pairs"]["overlapped_cpu"] for r in results), strict=True))
        bound = statistics.median(max(sum(rep) / cores, max(rep)) for rep in cpus)
        out.update(cpu_bound_ms=bound * 1e3, hidden_at_most=min(1.0, (seq - bound) / comm))
        if "sequential_cpu" in results[0]["pairs"]:
            out.update({f"{mode}_cpu_ms": statistics.median(statistics.mean(rep) for rep in zip(
                *(r["pairs"][f"{mode}_cpu"] for r in results), strict=True)) * 1e3
                for mode in ("sequential", "overlapped")})
    if "steps" in results[0]:
        off, on = statistics.median(slowest("off", "steps")), statistics.median(slowest("on", "steps"))
        out.update(step_off_ms=off * 1e3, step_on_ms=on * 1e3, step_ratio=on / off)
    return out


def report(s: dict[str, Any], cfg: MoEBenchConfig) -> str:
    """The figures in words."""
    where = ("emulated link " + (f"{s['link']['bandwidth_bytes_per_s'] / 1e6:.1f} MB/s, latency "
                                 f"{s['link']['latency_s'] * 1e3:g} ms" if s["link"] else "none")
             if cfg.backend == "gloo" else "real NCCL all-to-alls, no emulated link")
    mixer = f"causal attention over {cfg.seq}-token sequences" if cfg.mixer == "attention" else "a Linear mixer"
    lines = [f"MoE F&B pair ({cfg.backend}; {where}): {cfg.layers} MoE blocks ({mixer}), {cfg.experts} experts "
             f"top-{cfg.top_k}, {cfg.tokens} tokens x {cfg.dim} per rank",
             f"  F then B   {s['sequential_ms']:8.2f} ms  (comm {s['comm_ms']:.2f} ms, compute "
             f"{s['compute_ms']:.2f} ms)",
             f"  overlapped {s['overlapped_ms']:8.2f} ms  ratio {s['pair_ratio']:.2f}, hidden {s['hidden']:.0%} of "
             "the comm"]
    if "cpu_bound_ms" in s:
        lines.append(f"  the cores' bound on the overlapped pair (the ranks' CPU time over the cores) "
                     f"{s['cpu_bound_ms']:.2f} ms: at most {s['hidden_at_most']:.0%} of the comm can be hidden here")
    if "sequential_cpu_ms" in s:
        lines.append(f"  CPU time per rank (mean over ranks): F then B {s['sequential_cpu_ms']:.2f} ms, overlapped "
                     f"{s['overlapped_cpu_ms']:.2f} ms")
    if "step_ratio" in s:
        lines.append(f"  DualPipeV step (PP=2 x DP=2, ep=2): off {s['step_off_ms']:.1f} ms, on {s['step_on_ms']:.1f} "
                     f"ms, ratio {s['step_ratio']:.2f}")
    return "\n".join(lines)


BEGIN = "<!-- moe-overlap:begin (generated by benchmarks/moe_overlap.py; edits inside are overwritten) -->"
END = "<!-- moe-overlap:end -->"


def markers(ranks: int) -> tuple[str, str]:
    """The docs section's begin and end lines for a run on `ranks` processes (4: the default section)."""
    if ranks == 4:
        return BEGIN, END
    return BEGIN.replace("moe-overlap:", f"moe-overlap-{ranks}:"), END.replace("moe-overlap:", f"moe-overlap-{ranks}:")


def markdown(out: dict[str, Any]) -> str:
    """The docs section: the command, what ran where, and the figures."""
    cfg = MoEBenchConfig(**out["config"])
    machine = out.get("machine", {})
    gpus = f"{cfg.ranks} ranks sharing it" if out.get("shared_gpu") else "a GPU per rank"
    where = (f"{out.get('device', 'GPU')} ({gpus}; real NCCL all-to-alls)" if cfg.backend == "nccl" else
             f"{machine.get('cores', '?')} CPU cores, {cfg.ranks} gloo processes, emulated link")
    command = ("python benchmarks/moe_overlap.py" + (" --backend nccl" if cfg.backend == "nccl" else "")
               + (f" --ranks {cfg.ranks}" if cfg.ranks != 4 else "")
               + f" --tokens {cfg.tokens} --dim {cfg.dim} --hidden {cfg.hidden} --mixer {cfg.mixer}"
               + (f" --seq {cfg.seq}" if cfg.mixer == "attention" else "") + f" --reps {cfg.reps} --steps {cfg.steps}")
    return "\n".join([f"Measured on {where}, torch {machine.get('torch', '?')}, {out.get('date', '?')}; "
                      f"`{command}`.", "", "```", report(out, cfg), "```", "", targets(out, cfg.backend)])


def targets(out: dict[str, Any], backend: str) -> str:
    """Issue 20's targets against the figures: met or missed, each with its measured value."""
    def verdict(ok: bool) -> str:
        return "met" if ok else "missed"

    hidden_target = 0.8 if backend == "nccl" else 0.7
    hidden = (f">= {hidden_target:.0%} of the comm hidden: {verdict(out['hidden'] >= hidden_target)} "
              f"({out['hidden']:.0%})")
    if backend == "nccl":
        return f"Target: {hidden}."
    ratio = out["pair_ratio"]
    return f"Targets: pair <= 0.75x F then B: {verdict(ratio <= 0.75)} ({ratio:.2f}x); {hidden}."


def publish(out: dict[str, Any], docs: str) -> None:
    """Write the section between BEGIN and END of docs/benchmarks.md."""
    from benchmarks import report as docs_report

    docs_report.update_doc(os.path.join(docs, "benchmarks.md"), markdown(out), *markers(out["config"].get("ranks", 4)))


def run(cfg: MoEBenchConfig) -> dict[str, Any]:
    """Both parts on `cfg.ranks` processes; the summary with the config and machine."""
    world = cfg.ranks
    results = harness.spawn(worker, cfg, world, 1200.0, backend=cfg.backend)
    out = summary(results)
    out.update(config=asdict(cfg), machine=harness.machine_info(), date=time.strftime("%Y-%m-%d %H:%M UTC",
                                                                                        time.gmtime()))
    if cfg.backend == "nccl":
        out.update(device=torch.cuda.get_device_name(0), gpus=torch.cuda.device_count(),
                   shared_gpu=torch.cuda.device_count() < world)
    return out


def main(argv: list[str] | None = None) -> int:
    """Run and print; optionally save moe_overlap.json."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", choices=("gloo", "nccl"), default="gloo")
    parser.add_argument("--ranks", type=int, choices=(2, 4), default=MoEBenchConfig.ranks,
                        help="processes (2: one core each here; the DualPipeV step of part 2 needs 4)")
    parser.add_argument("--reps", type=int, default=MoEBenchConfig.reps)
    parser.add_argument("--steps", type=int, default=MoEBenchConfig.steps)
    parser.add_argument("--tokens", type=int, default=MoEBenchConfig.tokens)
    parser.add_argument("--dim", type=int, default=MoEBenchConfig.dim)
    parser.add_argument("--hidden", type=int, default=MoEBenchConfig.hidden, help="each expert's hidden width")
    parser.add_argument("--experts", type=int, default=MoEBenchConfig.experts)
    parser.add_argument("--comm-ratio", type=float, default=MoEBenchConfig.comm_ratio)
    parser.add_argument("--mixer", choices=("attention", "linear"), default=MoEBenchConfig.mixer,
                        help="each block's mixer: causal self-attention (default) or one Linear")
    parser.add_argument("--seq", type=int, default=MoEBenchConfig.seq, help="tokens per sequence (attention)")
    parser.add_argument("--quick", action="store_true", help="a tiny smoke run (2 reps, 2 steps, 64 tokens)")
    parser.add_argument("--out", help="directory for moe_overlap.json")
    parser.add_argument("--docs", default="", help="docs directory: write the section in DIR/benchmarks.md")
    args = parser.parse_args(argv)
    if min(args.reps, args.tokens, args.dim, args.hidden) < 1 or args.steps < 0 or not args.comm_ratio > 0:
        parser.error("need --reps, --tokens, --dim, --hidden >= 1, --steps >= 0, --comm-ratio > 0")
    if args.experts < 4 or args.experts % 4:
        parser.error(f"--experts must be a multiple of 4 (spread over 4 ranks), got {args.experts}")
    if args.mixer == "attention" and (args.seq < 1 or args.tokens % args.seq or args.dim % 4):
        parser.error(f"--mixer attention needs --seq >= 1 dividing --tokens {args.tokens} (got {args.seq}) and "
                     f"--dim divisible by its 4 heads (got {args.dim})")
    if args.backend == "nccl":
        if not torch.cuda.is_available():
            parser.error("--backend nccl needs a CUDA GPU")
        if torch.cuda.device_count() < 4:
            os.environ[SHARE_GPU_ENV] = "1"
    cfg = MoEBenchConfig(tokens=args.tokens, dim=args.dim, hidden=args.hidden, experts=args.experts, reps=args.reps,
                         steps=args.steps, comm_ratio=args.comm_ratio, backend=args.backend, mixer=args.mixer,
                         seq=args.seq, ranks=args.ranks)
    if args.quick:
        cfg = replace(cfg, tokens=64, dim=32, hidden=64, reps=2, steps=2, seq=16)
    out = run(cfg)
    print(report(out, cfg))
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "moe_overlap.json").write_text(json.dumps(out, indent=2))
    if args.docs:
        publish(out, args.docs)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
