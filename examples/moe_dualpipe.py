"""A small DeepSeek-style MoE transformer trained with DualPipeV on 4 CPU processes (PP=2 x DP=2, experts spread
over ep=2), each F&B pair hiding one microbatch's expert all-to-alls behind the other's compute; it draws the
measured timeline with the expert-parallel ("ep") lane under each rank.

Run it:  python examples/moe_dualpipe.py [--steps 60] [--link-ms 2] [--out moe-output]
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from duplexpipe import Pipeline, PipelineConfig, make_mesh, run
from duplexpipe.comm.link import LinkModel  # a benchmarking aid, outside the public API
from duplexpipe.launch.tasks.gpt import CharCorpus
from duplexpipe.moe import CausalSelfAttention, MoEBlock, MoELayer
from duplexpipe.runtime import gather_timeline
from duplexpipe.runtime.link_emulator import emulate_link


def build_model(vocab: int, dim: int = 64, layers: int = 4, experts: int = 8) -> tuple[nn.Module, list[nn.Module],
                                                                                          nn.Module]:
    """(embedding, `layers` MoE blocks, head): each block is attention, then 8 fine-grained experts top-2 + 1
    shared with a sigmoid router and aux-loss-free balancing through the expert bias."""
    torch.manual_seed(0)
    blocks = [MoEBlock(dim, MoELayer(dim, dim, experts, 2, shared_experts=1, router="sigmoid",
                                     bias_update_speed=1e-3), mixer=CausalSelfAttention(dim, 4)) for _ in range(layers)]
    return nn.Embedding(vocab, dim), blocks, nn.Sequential(nn.LayerNorm(dim), nn.Linear(dim, vocab))


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-character cross entropy."""
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def train(steps: int, link_ms: float, out: str) -> dict[str, Any]:
    """One rank's part of the run (called in 4 processes by `run`)."""
    torch.set_num_threads(1)
    corpus = CharCorpus()
    config = PipelineConfig(schedule="dualpipev", num_microbatches=8, fb_overlap=True)
    embedding, blocks, head = build_model(corpus.vocab_size)
    pipe = Pipeline.from_layers(blocks, lm_loss, lambda ps: torch.optim.AdamW(ps, lr=3e-3), config,
                                embedding=embedding, head=head, mesh=make_mesh(2, 2, ep=2))
    if link_ms:  # every all-to-all held for an emulated link's latency: honest overlap on shared CPU cores
        emulate_link(pipe.runtime, LinkModel(latency_s=link_ms / 1e3))
    losses, start = [], time.perf_counter()
    for step in range(steps):
        tokens, targets = corpus.batch(step * 2 + pipe.groups.dp_rank, 16, 32)  # each replica its own batch
        losses.append(pipe.step(tokens, targets))
    wall = time.perf_counter() - start
    timeline = pipe.last.timeline if pipe.last is not None else None
    merged = gather_timeline(timeline, pipe.groups.pp_group) if timeline is not None else None
    if merged is not None and torch.distributed.get_rank() == 0:
        from duplexpipe.viz import plot_timeline_lanes

        Path(out).mkdir(parents=True, exist_ok=True)
        plot_timeline_lanes(merged, Path(out) / "moe_dualpipev_measured.png",
                            title="DualPipeV, MoE with ep=2: the last step as measured (data-parallel replica 0)")
    return {"losses": losses, "wall_s": wall}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--link-ms", type=float, default=0.0,
                        help="emulate a link with this latency per expert all-to-all (0: none)")
    parser.add_argument("--out", default="moe-output")
    args = parser.parse_args()
    result = run(train, 4, (args.steps, args.link_ms, args.out))[0]
    losses = result["losses"]
    print(f"DualPipeV, 4 MoE blocks (8 experts top-2 + 1 shared), PP=2 x DP=2 with ep=2: loss {losses[0]:.3f} -> "
          f"{losses[-1]:.3f} in {args.steps} steps ({result['wall_s']:.1f} s)")
    print(f"measured timeline with the expert-parallel lane: {Path(args.out) / 'moe_dualpipev_measured.png'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
