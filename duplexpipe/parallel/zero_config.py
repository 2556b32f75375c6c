"""ZeRO's checks against the model and schedule (hpZ, tied weights); its options (`ZeroOptions`) and stage rules
live torch-free in `duplexpipe.dp_options.zero`."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from duplexpipe.schedules.ir import Op, Schedule

if TYPE_CHECKING:  # its one home; not a name of this module
    from duplexpipe.dp_options.zero import ZeroOptions

__all__ = ["check_hpz", "check_tied"]


def check_hpz(options: ZeroOptions, schedule: Schedule, dp_size: int, zero_stage: int = 2) -> None:
    """hpZ needs a data-parallel size that its group size divides (and exceeds); under ZeRO-2 also a schedule
    without I/W (ZeRO-3 reshards at the schedule's RESHARD actions, after a stage's W)."""
    ranks = options.hpz_ranks
    if ranks is None:
        return
    if dp_size % ranks or dp_size == ranks:
        raise ValueError(f"ZeroOptions.hpz_ranks={ranks} must divide the data-parallel size {dp_size} and be "
                         "smaller than it (ranks per node, with at least two nodes)")
    split = sorted({part.op.value for row in schedule.actions for action in row for part in action.compute_parts()
                    if part.op in (Op.I, Op.W)})
    if split and zero_stage == 2:
        raise ValueError(f"ZeroOptions.hpz_ranks with zero_stage=2 needs a schedule without split backward, but "
                         f"{schedule.name!r} runs {split}: FSDP2 frees the parameters it resharded after "
                         "forward before the deferred weight gradients (W) run (measured: they come out missing); "
                         "use zero_stage=3, whose RESHARD actions follow each stage's W")


def check_tied(stage: int, tied: Sequence[Sequence[tuple[int, str]]], dp_size: int) -> None:
    """ZeRO with data parallelism cannot take a parameter shared by several model parts (`tied`: each one's
    (part, name) places): its gradient leaves the parameter for a shard before the tied-gradient sum runs."""
    if stage and dp_size > 1 and tied:
        places = ["+".join(f"part {part} {name}" for part, name in group) for group in tied]
        raise ValueError(f"zero_stage={stage} does not support parameters shared by several model parts (tied: "
                         f"{places}); untie them (e.g. tie_word_embeddings=False) or use zero_stage=0")
