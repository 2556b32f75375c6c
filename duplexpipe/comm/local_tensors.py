"""A DTensor's local tensor (sharing its storage), and a local tensor wrapped in another DTensor's layout."""

from __future__ import annotations

from torch import Tensor
from torch.distributed.tensor import DTensor


def local_of(t: Tensor) -> Tensor:
    """The local tensor of a DTensor (sharing its storage), or `t` itself."""
    return t._local_tensor if isinstance(t, DTensor) else t  # type: ignore[no-any-return]


def laid_out_like(local: Tensor, template: Tensor) -> Tensor:
    """`local` as a DTensor with `template`'s mesh, placements, shape and stride (`local` itself when `template`
    is a plain tensor): e.g. a gradient summed over local tensors, given back the layout of the one it replaces."""
    if not isinstance(template, DTensor):
        return local
    return DTensor.from_local(local, template.device_mesh, template.placements, run_check=False,
                              shape=template.shape, stride=template.stride())
