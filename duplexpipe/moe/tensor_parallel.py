"""The tensor-parallel plan of `MoEBlock`s with `CausalSelfAttention`: the attention sharded, the experts whole."""

from __future__ import annotations

from torch.distributed.tensor import Placement, Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
)

from duplexpipe.tp.style import ReplicatedWithGradAllReduce, ScatterSequence


def moe_tp_plan(blocks: str = "layer*", sequence_parallel: bool = False, *, embedding: str | None = None,
                head: str | None = None) -> dict[str, ParallelStyle]:
    """The plan of the `MoEBlock`s at module paths `blocks` (an fnmatch pattern; `Pipeline.from_layers` names its
    layers `layer<i>`) whose mixer is a `CausalSelfAttention`: q, k and v by columns, the output projection by rows;
    the MoE layers stay whole (their experts are spread by expert parallelism, not by TP).

    `sequence_parallel`: the norms and the residual stream hold 1/TP of the sequence, the attention all-gathers its
    input and reduce-scatters its output, and each TP rank routes and dispatches only its own tokens (no token is
    sent twice); the router's and experts' gradients are then partial over TP and summed once a stage's gradients
    are final. `embedding` / `head` (module paths of the first and last parts' modules around the blocks) then
    scatter the sequence after the embedding and gather it before the head.
    """
    rest: Placement = Shard(1) if sequence_parallel else Replicate()
    plan: dict[str, ParallelStyle] = {f"{blocks}.mixer.{name}": ColwiseParallel() for name in ("q", "k", "v")}
    plan[f"{blocks}.mixer.out"] = RowwiseParallel(output_layouts=rest)
    if not sequence_parallel:
        return plan
    gather = PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),), use_local_output=True)
    plan.update({f"{blocks}.norm1": SequenceParallel(use_local_output=True), f"{blocks}.mixer": gather,
                 f"{blocks}.norm2": SequenceParallel(use_local_output=True),
                 f"{blocks}.moe": ReplicatedWithGradAllReduce()})
    if embedding is not None:
        plan[embedding] = ScatterSequence()
    if head is not None:
        plan[head] = gather
    return plan
