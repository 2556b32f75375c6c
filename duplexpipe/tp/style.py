"""Tensor-parallel styles that models and MoE layers share: scatter the sequence, mark gradients partial over TP."""

from __future__ import annotations

from typing import Any

from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import ParallelStyle

PARTIAL_OVER_TP = "_duplexpipe_partial_over_tp"
"""Set on a module by `ReplicatedWithGradAllReduce`: its plain parameters' gradients are partial sums over TP."""


class ScatterSequence(ParallelStyle):
    """A module whose output is replicated over the TP group keeps only this rank's 1/TP of the sequence dimension
    (the backward gathers the gradient): where sequence parallelism starts, e.g. on the embedding."""

    def __init__(self, *, sequence_dim: int = 1) -> None:
        super().__init__()
        self.sequence_dim = sequence_dim

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        dim, name = self.sequence_dim, type(module).__name__

        def scatter(_module: nn.Module, _args: Any, output: Tensor) -> Tensor:
            size, tp = output.shape[dim], device_mesh.size()
            if size % tp:
                raise ValueError(f"sequence parallelism: the output of {name} has {size} positions along dim {dim}, "
                                 f"not divisible by the TP degree {tp}")
            whole = DTensor.from_local(output, device_mesh, (Replicate(),), run_check=False)
            return whole.redistribute(device_mesh, (Shard(dim),)).to_local()

        module.register_forward_hook(scatter)
        return module


class ReplicatedWithGradAllReduce(ParallelStyle):
    """A module that computes on this TP rank's own part of the data (its sequence shard under sequence parallelism,
    its local heads) with whole, replicated parameters (transformers' "replicated_with_grad_allreduce"; an MoE layer
    under sequence parallelism): nothing changes in its forward; its parameters' gradients are partial sums over the
    TP group, which the Pipeline sums once a stage's gradients are final."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        setattr(module, PARTIAL_OVER_TP, True)
        return module
