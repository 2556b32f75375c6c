"""A tiny Hugging Face LlamaForCausalLM (random init from a config, no download), pipelined with DualPipe.

Trains character-level on the bundled corpus (Genesis and Exodus, King James Version) and prints the
loss and the measured bubble ratio. Needs the hf extra: pip install -e '.[hf]'.

Run it:      python examples/hf_llama.py [--schedule dualpipe --ranks 4 --microbatches 8 --steps 60]
Or torchrun: torchrun --nproc-per-node 4 examples/hf_llama.py
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from gpt import CharCorpus  # noqa: E402  (examples/ is not a package)
from transformers import LlamaConfig, LlamaForCausalLM  # noqa: E402

from duplexpipe.launch.processes import run  # noqa: E402
from duplexpipe.model.hf import causal_lm_loss, causal_lm_parts  # noqa: E402
from duplexpipe.planner.calibrate import fit_cost_model  # noqa: E402
from duplexpipe.runtime import gather_timeline  # noqa: E402
from duplexpipe.schedules.registry import build as build_schedule  # noqa: E402
from duplexpipe.schedules.simulate import simulate  # noqa: E402
from duplexpipe.train.trainer import Pipeline, PipelineConfig  # noqa: E402


def build_llama(vocab_size: int, layers: int, hidden: int = 64, seed: int = 0) -> LlamaForCausalLM:
    """A small Llama (grouped-query attention, rotary embeddings) from a config, initialised from `seed`."""
    config = LlamaConfig(vocab_size=vocab_size, hidden_size=hidden, intermediate_size=2 * hidden,
                         num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=256, bos_token_id=None, eos_token_id=None,
                         attn_implementation="sdpa")
    torch.manual_seed(seed)  # every rank builds the same weights
    return LlamaForCausalLM(config)


def train(schedule: str, microbatches: int, steps: int, layers: int, batch_size: int,
          block_size: int) -> dict[str, Any] | None:
    """Runs on every rank: build the model, split it, train; rank 0 returns the losses and timeline."""
    corpus = CharCorpus()
    num_parts = build_schedule(schedule, dist.get_world_size(), microbatches).num_groups
    model = build_llama(corpus.vocab_size, max(layers, num_parts))
    parts = causal_lm_parts(model, num_parts)
    config = PipelineConfig(schedule=schedule, num_microbatches=microbatches, grad_clip_norm=1.0)
    pipe = Pipeline(parts, causal_lm_loss, lambda ps: torch.optim.AdamW(ps, lr=3e-3, weight_decay=0.01), config)
    losses = []
    start = time.perf_counter()
    for step in range(steps):
        ids, _ = corpus.batch(step, batch_size, block_size)
        losses.append(pipe.step(ids, ids))  # the model shifts the labels itself: labels = input_ids
        if dist.get_rank() == 0 and (step % 10 == 0 or step == steps - 1):
            print(f"step {step:4d}  loss {losses[-1]:.4f}", flush=True)
    seconds = time.perf_counter() - start
    last = pipe.last.timeline if pipe.last is not None else None
    timeline = gather_timeline(last, group=pipe.groups.pp_group) if last is not None else None
    if dist.get_rank() != 0:
        return None
    simulated = simulate(pipe.schedule, fit_cost_model(timeline)) if timeline is not None else None
    return {"losses": losses, "bubble": timeline.bubble_ratio if timeline is not None else None,
            "simulated_bubble": simulated.bubble_ratio if simulated is not None else None,
            "seconds": seconds, "params": sum(p.numel() for p in model.parameters()),
            "layers": [list(p.layer_ids) for p in parts]}


def main(argv: list[str] | None = None) -> int:
    """Parse options, train on every rank and report from rank 0."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--schedule", default="dualpipe")
    parser.add_argument("--ranks", type=int, default=4, help="local processes when not under torchrun")
    parser.add_argument("--microbatches", type=int, default=8)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--layers", type=int, default=4, help="decoder layers (at least one per model part)")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--block-size", type=int, default=64)
    args = parser.parse_args(argv)
    results = run(train, args.ranks, (args.schedule, args.microbatches, args.steps, args.layers,
                                      args.batch_size, args.block_size))
    result = results[0]
    if result is None:  # under torchrun, ranks other than 0
        return 0
    losses = result["losses"]
    tokens = args.batch_size * args.block_size * len(losses)
    print(f"LlamaForCausalLM, {result['params']:,} parameters, layers per part {result['layers']}")
    print(f"{args.schedule} on {args.ranks} ranks, {args.microbatches} microbatches: "
          f"loss {losses[0]:.3f} -> {losses[-1]:.3f} in {len(losses)} steps "
          f"({tokens / result['seconds']:,.0f} tokens/s overall)")
    if result["bubble"] is not None:
        print(f"measured bubble ratio of the last step: {result['bubble']:.1%} (simulated with its measured "
              f"per-stage costs: {result['simulated_bubble']:.1%})")
    return 0


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    sys.exit(main())
