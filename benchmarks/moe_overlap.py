"""Part: how much of the expert all-to-all one MoE F&B pair hides behind the other microbatch's compute."""

from __future__ import annotations

import os
import statistics
import time
from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from benchmarks import harness, runner
from benchmarks import internals as deep
from benchmarks.framework import Block, Part, Result, met
from duplexpipe import Pipeline, PipelineConfig, causal_lm_loss, causal_lm_parts, make_mesh
from duplexpipe.moe import CausalSelfAttention, ExpertGroup, MoEBlock, MoELayer, moe_layers
from duplexpipe.train.compile import compile_targets, torch_compile_kwargs
from duplexpipe.train.pipeline_config import ObserveConfig

MODELS = ("duplexpipe", "qwen3_moe")
"""What a stage is made of: duplexpipe.moe's MoEBlocks, or transformers' Qwen3-MoE decoder layers (their attention and
norms, each sparse block a duplexpipe.moe layer routed as Qwen3-MoE routes) through `causal_lm_parts`."""
VOCAB = 256
"""The Qwen3-MoE model's vocabulary (the step's token ids)."""


@dataclass(frozen=True)
class MoEBenchConfig:
    """An MoE F&B pair run one after the other and interleaved at its comm points (hidden: the share of its comm
    saved), and a DualPipeV step (PP=2 x DP=2, ep=2) with fb_overlap on and off; gloo: an emulated link."""

    tokens: int = 512  # tokens per microbatch per rank
    dim: int = 128
    hidden: int = 256  # each expert's hidden width
    experts: int = 8
    top_k: int = 2
    layers: int = 2  # MoE blocks in the stage
    mixer: str = "attention"  # "attention" (causal, 4 heads, over `seq`-token sequences) or "linear" (one Linear)
    model: str = "duplexpipe"  # MoEBlocks with `mixer` + a shared expert, or "qwen3_moe": transformers' layers
    seq: int = 128  # tokens per sequence (the attention mixer)
    reps: int = 9  # timed pairs per mode (after 2 untimed)
    steps: int = 6  # timed DualPipeV steps per mode (after 1 untimed); 0 skips the step
    comm_ratio: float = 1.0  # gloo: the emulated link makes the pair's comm this many times its compute
    link_latency_s: float = 0.0  # gloo: the emulated link's latency per all-to-all (comm_ratio sets its bandwidth)
    backend: str = "gloo"
    ranks: int = 4  # processes (the pair's expert-parallel group): 4, or 2; the step runs only with 4
    compile: str = ""  # torch.compile backend of the pieces around the experts (as PipelineConfig.compile); "": eager

    def __post_init__(self) -> None:
        if min(self.reps, self.tokens, self.dim, self.hidden) < 1 or self.steps < 0 or not self.comm_ratio > 0:
            raise ValueError("need reps, tokens, dim, hidden >= 1, steps >= 0, comm_ratio > 0")
        if self.ranks not in (2, 4) or self.backend not in ("gloo", "nccl"):
            raise ValueError(f"ranks must be 2 or 4 and backend gloo or nccl, got {self.ranks}, {self.backend!r}")
        if self.experts < 4 or self.experts % 4:
            raise ValueError(f"experts must be a multiple of 4 (spread over 4 ranks), got {self.experts}")
        if self.model not in MODELS:
            raise ValueError(f"model must be one of {MODELS}, got {self.model!r}")
        if (self.mixer == "attention" or self.model == "qwen3_moe") and (self.seq < 1 or self.tokens % self.seq
                                                                        or self.dim % 8):
            raise ValueError(f"attention needs seq >= 1 dividing tokens {self.tokens} (got {self.seq}) and dim "
                             f"divisible by its 4 heads of even width (got {self.dim})")


QUICK = MoEBenchConfig(tokens=64, dim=32, hidden=64, reps=2, steps=2, seq=16)


def _blocks(cfg: MoEBenchConfig, count: int) -> list[MoEBlock]:
    torch.manual_seed(0)
    return [MoEBlock(cfg.dim, MoELayer(cfg.dim, cfg.hidden, cfg.experts, cfg.top_k, shared_experts=1),
                     mixer=CausalSelfAttention(cfg.dim, 4) if cfg.mixer == "attention" else nn.Linear(cfg.dim, cfg.dim))
            for _ in range(count)]


def _qwen3(cfg: MoEBenchConfig, layers: int) -> nn.Module:
    """A Qwen3-MoE causal LM of `layers` decoder layers shaped by `cfg` (transformers' own classes, random weights)."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    settings: dict[str, Any] = dict(
        hidden_size=cfg.dim, intermediate_size=cfg.hidden, moe_intermediate_size=cfg.hidden, num_experts=cfg.experts,
        num_experts_per_tok=cfg.top_k, norm_topk_prob=True, num_hidden_layers=layers, num_attention_heads=4,
        num_key_value_heads=2, head_dim=cfg.dim // 4, vocab_size=VOCAB, max_position_embeddings=cfg.seq,
        attn_implementation="sdpa")
    torch.manual_seed(0)
    return Qwen3MoeForCausalLM(Qwen3MoeConfig(**settings))


def _model(cfg: MoEBenchConfig, device: torch.device, rank: int, world: int) -> nn.Module:
    if cfg.model == "qwen3_moe":  # the middle part of a model: hidden states in, hidden states out
        stage = causal_lm_parts(_qwen3(cfg, cfg.layers + 2), 3, balance=[1, cfg.layers, 1])[1].to(device)
        for layer in moe_layers(stage):
            layer.shard_experts(ExpertGroup(None, rank, world))
        return stage
    blocks = _blocks(cfg, cfg.layers)
    model = nn.Sequential(*blocks).to(device)
    for block in blocks:
        block.moe.shard_experts(ExpertGroup(None, rank, world))
        for piece, in_moe in compile_targets(block) if cfg.compile else ():
            piece.compile(**torch_compile_kwargs({"backend": cfg.compile}, split=False, moe=in_moe))
    return model


def _tokens(cfg: MoEBenchConfig, count: int, gen: torch.Generator | None = None) -> torch.Tensor:
    """`count` random tokens: [count / seq, seq, dim] for attention, else [count, dim]."""
    attention = cfg.mixer == "attention" or cfg.model == "qwen3_moe"
    shape = (count // cfg.seq, cfg.seq, cfg.dim) if attention else (count, cfg.dim)
    return torch.randn(*shape, generator=gen)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class _Measuring(deep.Driver):
    """Times each exchange alone: issued after a barrier with the device drained, waited for at once."""

    def __init__(self, device: torch.device, link: deep.LinkModel | None, log: list[deep.CommRecord]) -> None:
        def wait(work: Any, what: str) -> None:
            work.wait()
            _sync(device)

        super().__init__(wait=wait, link=link, log=log)
        self.device = device

    def post(self, issue: Any, label: str, nbytes: int = 0) -> deep.Posted:
        _sync(self.device)
        dist.barrier()
        posted = super().post(issue, label, nbytes)
        posted.joined.insert(0, posted.record.issued)  # every rank joined at the barrier, before the issue
        self.finish(posted)  # alone, like every exchange here (a later wait for it returns at once)
        return posted


def _pair(model: nn.Module, x: list[torch.Tensor], grad: torch.Tensor, base: deep.Driver, device: torch.device,
          mode: str) -> tuple[float, float]:
    """One timed pair, B of microbatch 0 and F of microbatch 1: (its wall time, this process's CPU time)."""
    slot = deep.CommSlot(deep.Driver(link=base.link))
    with deep.forward_slot(slot):
        y0 = model(x[0])
    _sync(device)
    dist.barrier()

    def backward() -> None:
        slot.driver = deep.current_driver(base)
        torch.autograd.backward(y0, grad)

    def forward() -> None:
        with deep.forward_slot(deep.CommSlot(deep.current_driver(base))):
            model(x[1])

    start, cpu = time.perf_counter(), time.process_time()
    if mode == "overlapped":
        deep.run_pair(backward, forward, base, device, defer_weights=True)
    else:
        backward()
        forward()
    _sync(device)
    return time.perf_counter() - start, time.process_time() - cpu


MODES = ("sequential", "overlapped", "measured")


def _pairs(cfg: MoEBenchConfig, rank: int, world: int, device: torch.device, link: deep.LinkModel | None,
           reps: int) -> dict[str, list[float]]:
    """Pair times per mode (alternating), each measured pair's comm time, each pair's CPU time."""
    model = _model(cfg, device, rank, world)
    gen = torch.Generator().manual_seed(rank)
    *x, grad = (_tokens(cfg, cfg.tokens, gen).to(device) for _ in range(3))  # microbatches 0 and 1, B's gradient
    out: dict[str, list[float]] = {m: [] for m in (*MODES, "comm", "overlapped_cpu", "sequential_cpu")}
    plain = deep.Driver(link=link)  # one driver, as a runtime keeps one: its pairs reuse its two threads
    for rep in range(reps + 2):
        for mode in MODES if rep % 2 == 0 else MODES[::-1]:
            log: list[deep.CommRecord] = []
            plain.log = log
            base = _Measuring(device, link, log) if mode == "measured" else plain
            took, cpu = _pair(model, x, grad, base, device, mode)
            if rep >= 2:
                out[mode].append(took)
                out["comm" if mode == "measured" else f"{mode}_cpu"].append(
                    sum(r.done - r.issued for r in log) if mode == "measured" else cpu)
            model.zero_grad(set_to_none=True)
    return out


def _link(cfg: MoEBenchConfig, rank: int, world: int, device: torch.device) -> tuple[deep.LinkModel | None, float]:
    """gloo: a link whose all-to-alls take comm_ratio x the pair's compute (F then B less its exchanges timed alone),
    the slowest rank's bandwidth, probed without a link, then corrected twice by probes with it. nccl: None."""
    if cfg.backend == "nccl":
        return None, 0.0
    model = _model(cfg, device, rank, world)
    log: list[deep.CommRecord] = []
    _pair(model, [_tokens(cfg, cfg.tokens).to(device)] * 2, _tokens(cfg, cfg.tokens).to(device),
          deep.Driver(log=log), device, "sequential")
    nbytes = sum(r.nbytes for r in log)
    link: deep.LinkModel | None = None
    compute = real = 0.0
    for _ in range(3):
        probe = _pairs(cfg, rank, world, device, link, 3)
        compute = statistics.median(t - c for t, c in zip(probe["sequential"], probe["comm"], strict=True))
        if link is None:
            real = statistics.median(probe["comm"])  # the link's time adds to the real transfers'
        wanted = max(cfg.comm_ratio * compute - real - cfg.link_latency_s * len(log), 1e-6)
        bandwidth = torch.tensor([nbytes / wanted], dtype=torch.float64, device=device)
        dist.all_reduce(bandwidth, op=dist.ReduceOp.MIN)
        link = deep.LinkModel(cfg.link_latency_s, float(bandwidth.item()))
    return link, compute


def _step_times(cfg: MoEBenchConfig, device: torch.device, link: deep.LinkModel | None) -> dict[str, list[float]]:
    """A DualPipeV step (PP=2 x DP=2, ep=2) with fb_overlap on and off, alternating."""
    mesh = make_mesh(2, 2, device.type, ep=2)
    pipes = [_step_pipeline(cfg, mesh, device, overlap) for overlap in (False, True)]
    for pipe in pipes:
        deep.emulate_link(pipe.runtime, link)
    gen = torch.Generator().manual_seed(dist.get_rank())
    x = (torch.randint(0, VOCAB, (8 * cfg.tokens // 2 // cfg.seq, cfg.seq), generator=gen) if cfg.model == "qwen3_moe"
         else _tokens(cfg, 8 * cfg.tokens // 2, gen)).to(device)

    def step(pipe: Pipeline, _: int) -> None:
        pipe.step(x, x)
        _sync(device)

    off, on = harness.RoundRobin(pipes, step).run(cfg.steps, warmup=1)
    return {"off": off.wall, "on": on.wall}


def _step_pipeline(cfg: MoEBenchConfig, mesh: Any, device: torch.device, overlap: bool) -> Pipeline:
    """DualPipeV on PP=2 x DP=2 (ep=2) over 4 x `layers` blocks (Qwen3-MoE: decoder layers with the embedding and
    head, trained on token ids)."""
    config = PipelineConfig(schedule="dualpipev", num_microbatches=8, fb_overlap=overlap,
                            compile={"backend": cfg.compile} if cfg.compile else False,
                            observe=ObserveConfig(record_timeline=False))
    sgd = lambda ps: torch.optim.SGD(ps, lr=1e-3)  # noqa: E731
    if cfg.model == "qwen3_moe":
        return Pipeline(causal_lm_parts(_qwen3(cfg, 4 * cfg.layers), 4), causal_lm_loss, sgd, config, mesh=mesh,
                        device=device)
    blocks: list[nn.Module] = [nn.Identity(), *_blocks(cfg, 4 * cfg.layers)]
    return Pipeline.from_layers(blocks, nn.functional.mse_loss, sgd, config, mesh=mesh, device=device)


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
    """Medians over the reps of the slowest rank: the pair each way, its comm and compute, the hidden fraction."""
    def slowest(key: str, part: str = "pairs") -> list[float]:
        return harness.slowest([r[part][key] for r in results])

    seq, ovl, measured, comm = (statistics.median(slowest(k)) for k in ("sequential", "overlapped", "measured", "comm"))
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


def run(cfg: MoEBenchConfig) -> Result:
    """Both parts on `cfg.ranks` processes; the summary with the config."""
    out = summary(harness.spawn(worker, cfg, cfg.ranks, 1200.0, backend=cfg.backend))
    out["config"] = asdict(cfg)
    if cfg.backend == "nccl":
        out.update(device=torch.cuda.get_device_name(0), gpus=torch.cuda.device_count(),
                   shared_gpu=torch.cuda.device_count() < cfg.ranks)
    return out


def report(s: Result) -> list[Block]:
    """The workload, the pair and step times, and issue 20's targets against them."""
    cfg = MoEBenchConfig(**s["config"])
    where = (("emulated link " + (f"{s['link']['bandwidth_bytes_per_s'] / 1e6:.1f} MB/s, latency "
                                  f"{s['link']['latency_s'] * 1e3:g} ms" if s["link"] else "none"))
             if cfg.backend == "gloo" else f"real NCCL all-to-alls on {s.get('device', 'GPU')} "
             f"({'ranks sharing it' if s.get('shared_gpu') else 'a GPU per rank'}), no emulated link")
    mixer = f"causal attention over {cfg.seq}-token sequences" if cfg.mixer == "attention" else "a Linear mixer"
    blocks = (f"{cfg.layers} Qwen3-MoE decoder layers of transformers (attention 4/2 heads with q/k norms over "
              f"{cfg.seq}-token sequences; the sparse blocks as duplexpipe.moe layers, no shared expert)"
              if cfg.model == "qwen3_moe" else f"{cfg.layers} MoE blocks ({mixer})")
    table = [["run", "ms", "of which"],
             ["F then B", f"{s['sequential_ms']:.2f}", f"comm {s['comm_ms']:.2f} ms, compute {s['compute_ms']:.2f} ms"],
             ["overlapped", f"{s['overlapped_ms']:.2f}", f"ratio {s['pair_ratio']:.2f}, hidden {s['hidden']:.0%} of "
              "the comm"]]
    if "cpu_bound_ms" in s:
        table.append(["the cores' bound on the overlapped pair (the ranks' CPU time over the cores)",
                      f"{s['cpu_bound_ms']:.2f}", f"at most {s['hidden_at_most']:.0%} of the comm can be hidden here"])
    if "sequential_cpu_ms" in s:
        table.append(["CPU time per rank (mean over ranks), F then B / overlapped", f"{s['sequential_cpu_ms']:.2f} / "
                      f"{s['overlapped_cpu_ms']:.2f}", ""])
    if "step_ratio" in s:
        table.append(["DualPipeV step (PP=2 x DP=2, ep=2), off / on", f"{s['step_off_ms']:.1f} / {s['step_on_ms']:.1f}",
                      f"ratio {s['step_ratio']:.2f}"])
    target = 0.8 if cfg.backend == "nccl" else 0.7
    hidden = f">= {target:.0%} of the comm hidden: {met(s['hidden'] >= target)} ({s['hidden']:.0%})"
    pair = f"pair <= 0.75x F then B: {met(s['pair_ratio'] <= 0.75)} ({s['pair_ratio']:.2f}x); "
    compiled = f", the pieces around the experts compiled with {cfg.compile}" if cfg.compile else ""
    return [f"MoE F&B pair ({cfg.backend}, {cfg.ranks} processes; {where}): {blocks}{compiled}, "
            f"{cfg.experts} experts top-{cfg.top_k}, {cfg.tokens} tokens x {cfg.dim} per rank.", table,
            f"Target: {hidden}." if cfg.backend == "nccl" else f"Targets: {pair}{hidden}."]


def _block(result: Result) -> str:
    """The docs block of a result: by its model and ranks."""
    config = result.get("config", {})
    name = "moe-overlap" + ("-qwen3" if config.get("model", "duplexpipe") == "qwen3_moe" else "")
    name = name if config.get("ranks", 4) == 4 else f"{name}-2"
    return name + ("-compiled" if config.get("compile") else "")


PART = Part("moe_overlap", "MoE F&B overlap", MoEBenchConfig(), QUICK, run, report, block=_block)

if __name__ == "__main__":
    raise SystemExit(runner.main(only=PART.name))
