"""Reports NaN/inf in tensors sent through a codec: counted always, warned once, or raised (strict).

A lossy codec must never turn a non-finite tensor into finite garbage: fp16 training relies on inf/NaN
gradients reaching the overflow check, which then skips the step on every rank. The codecs keep them
non-finite (a scaled row or block holding one decodes to NaN); this module makes the event visible:
- "warn" (default): every send holding a non-finite value is counted (`events`, `last`), and the first
  one per watch raises a RuntimeWarning naming where it happened (rank, stage, microbatch, direction)
  and the codec. Use it for fp16 training, where overflowing steps are routine.
- "raise": the send fails with NonFiniteSendError naming the same; the runtime then stops every rank.
  For debugging fp32/bf16 runs (not allowed with fp16 precision: its overflows would crash the run).

Checks stay on the device: a codec's `nonfinite(payloads)` (the scaled codecs count their NaN scales),
otherwise a count over the tensor. On a CPU tensor, or under "raise", the count is read at once; on an
accelerator the counts are kept and read together by `flush()` (the runtime calls it at the end of a step),
so a send never waits for the device.

A tensor the runtime keeps out of a codec because it held NaN, inf or a float extreme (`extremes`) when
its message's shapes were learned travels exactly: `kept_exact` reports it (warned once; NaN/inf also
count as events and stop the run under "raise"), and `exact_sends` counts every send of such a tensor.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence

import torch
from torch import Tensor

from duplexpipe.comm.codec import Codec
from duplexpipe.dp_options.p2p import NONFINITE_POLICIES as NONFINITE_POLICIES
from duplexpipe.dp_options.p2p import check_policy
from duplexpipe.errors import NonFiniteSendError

EXTREME_SHARE = 0.5
"""A finite value is a float extreme when its magnitude reaches this share of the largest finite value of
float32 or of its own dtype, whichever is smaller: a masking constant such as `torch.finfo(dtype).min`,
which a scaled codec's fp32 arithmetic can overflow into inf or NaN."""
Unread = tuple[str, str, Tensor, str]
"""A send's non-finite count not read yet: (where, codec name, count, unit)."""


def extreme_limit(dtype: torch.dtype) -> float:
    """The magnitude from which a value of `dtype` is a float extreme (see EXTREME_SHARE)."""
    return EXTREME_SHARE * min(torch.finfo(dtype).max, torch.finfo(torch.float32).max)


def extremes(tensor: Tensor) -> Tensor:
    """How many elements of a floating tensor are NaN, inf or a float extreme (0-d, on its device; no sync)."""
    return (~(tensor.abs() < extreme_limit(tensor.dtype))).sum()


class NonFiniteWatch:
    """Counts and reports sends whose tensor held NaN or inf (see the module doc for the policies)."""

    def __init__(self, policy: str = "warn") -> None:
        self.policy = check_policy(policy, "the non-finite policy")
        self.events = 0
        """Sends so far whose tensor held NaN or inf."""
        self.last = ""
        """A description of the latest such send ('' while there was none)."""
        self.exact_sends = 0
        """Sends of a tensor kept out of its codec because it held NaN, inf or a float extreme (`kept_exact`)."""
        self._warned = False
        self._warned_exact = False

    def note(self, codec: Codec, tensor: Tensor, payloads: Sequence[Tensor], where: str,
             unread: list[Unread] | None = None) -> None:
        """Check one tensor sent with `codec` as `payloads`; `where` names the send (rank, stage, microbatch).
        An accelerator tensor's count goes to `unread` (the step's, read at its end by `read`: one sync for all)
        unless the policy raises or no list is given."""
        counter = getattr(codec, "nonfinite", None)
        if callable(counter):
            count, unit = counter(payloads), "scaled rows/blocks"
        else:
            count, unit = (~tensor.isfinite()).sum(), "elements"
        entry = (where, codec.name, count, unit)
        if self.policy == "raise" or count.device.type == "cpu" or unread is None:
            self._report(entry)
        else:
            unread.append(entry)

    def kept_exact(self, codec: Codec, tensor: Tensor, count: int, where: str, path: str) -> None:
        """Report a tensor that travels exactly instead of through `codec`, in every step with these input shapes,
        because `count` of its values were NaN, inf or float extremes; `where` names the send, `path` the leaf."""
        nonfinite = int((~tensor.isfinite()).sum())
        if nonfinite:
            self._report((where, codec.name, torch.tensor(nonfinite), "elements"),
                         f"{path} is sent exactly, as it is", warn=False)  # the warning below says it
        if not self._warned_exact:
            self._warned_exact = True
            warnings.warn(f"{where}: {path} holds {count} values that are NaN, inf or float extremes (|x| >= "
                          f"{extreme_limit(tensor.dtype):.3g}), which codec {codec.name!r} cannot carry: this "
                          "tensor travels exactly in every step with these input shapes (each such send is "
                          "counted in PipelineRuntime.nonfinite.exact_sends)", RuntimeWarning, stacklevel=2)

    def read(self, unread: list[Unread]) -> None:
        """Read the counts `note` kept for accelerator tensors (one sync for all) and report the non-zero ones."""
        for entry in unread:
            self._report(entry)

    def _report(self, entry: Unread,
                fate: str = "it arrives with NaN there (never rescaled to finite values)", warn: bool = True) -> None:
        where, name, counted, unit = entry
        count = int(counted)
        if not count:
            return
        self.events += 1
        self.last = f"{where}: a tensor sent with codec {name!r} held NaN or inf ({count} {unit}); {fate}"
        if self.policy == "raise":
            raise NonFiniteSendError(self.last)
        if warn and not self._warned:
            self._warned = True
            warnings.warn(f"{self.last}. Further events are only counted (fp16 overflow steps are skipped "
                          "as usual); the 'raise' policy stops instead.", RuntimeWarning, stacklevel=2)
