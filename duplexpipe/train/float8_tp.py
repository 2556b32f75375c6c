"""torchao's float8 tensor-parallel styles in place of torch's plain ones, on the linears where they compute torchao's
single-process float8 math.

torchao's `Float8ColwiseParallel` / `Float8RowwiseParallel` cast a Float8Linear's input to float8 before its TP
collective (with the whole DTensor's scale: the cast a single process makes) and the gradient of the module's OUTPUT
once, before the bias's gradient is summed from it; a single process casts inside the matmul's backward, after the
bias. So they equal torchao's single process only on linears without a bias (with one, the bias gradients move by
float8 e5m2's rounding; weight and input gradients stay equal), with tensorwise dynamic unrounded casts (what the
styles cast with), and over gloo only where no float8 crosses a collective (gloo has no float8 collectives).
`Float8Styles` swaps them in there and keeps the plain styles elsewhere. A plan's `PrepareModuleInput` is never
swapped for `PrepareFloat8ModuleInput` (exact only where the module's input feeds float8 linears alone, which only
the plan's author knows)."""

from __future__ import annotations

import logging
from typing import Any

from torch import nn
from torch.distributed.tensor import Replicate
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, RowwiseParallel
from torchao.float8.config import ScalingGranularity, ScalingType
from torchao.float8.float8_linear import Float8Linear
from torchao.float8.float8_tensor_parallel import Float8ColwiseParallel, Float8RowwiseParallel

LOG = logging.getLogger("duplexpipe.float8")
FLOAT8_STYLES: dict[type[ParallelStyle], type[ColwiseParallel] | type[RowwiseParallel]] = {
    ColwiseParallel: Float8ColwiseParallel, RowwiseParallel: Float8RowwiseParallel}
"""torch's plain style -> torchao's float8 style that replaces it."""
BIAS = "a bias (the styles cast the output gradient to float8 before the bias gradient is summed from it)"
SCALING = "casts other than tensorwise, dynamic and unrounded (the rowwise recipe: torchao's styles cast tensorwise)"
GLOO = "layouts that would move float8 through a TP collective, which gloo cannot carry (sequence parallelism)"


def moves_float8(style: ParallelStyle) -> bool:
    """Whether torchao's float8 version of a plain column or row style sends float8 through a TP collective: a
    column style that gathers its input (a sequence shard), a row style that scatters its output (its backward
    all-gathers the float8 output gradient)."""
    old: Any = style
    if isinstance(style, ColwiseParallel):
        return bool(old.input_layouts[0] != old.desired_input_layouts[0])
    return not isinstance(old.output_layouts[0], Replicate)


def plain_reason(module: Float8Linear) -> str | None:
    """Why torchao's float8 TP styles would not compute torchao's single-process math on `module` (None: they do)."""
    if module.bias is not None:
        return BIAS
    c = module.config
    casts = (c.cast_config_input, c.cast_config_weight, c.cast_config_grad_output)
    same = (c.cast_config_input_for_grad_weight == c.cast_config_input
            and c.cast_config_weight_for_grad_input == c.cast_config_weight
            and c.cast_config_grad_output_for_grad_weight == c.cast_config_grad_output)
    tensorwise = all(x.scaling_type is ScalingType.DYNAMIC and x.scaling_granularity is ScalingGranularity.TENSORWISE
                     for x in casts)
    return None if same and tensorwise and not c.round_scales_to_power_of_2 else SCALING


class Float8Styles:
    """A `tp.plans.Restyle`: torch's plain ColwiseParallel / RowwiseParallel on a Float8Linear become torchao's
    float8 styles with the same layouts where `plain_reason` finds none (and, over gloo, where they move no float8
through a collective: `moves_float8`); every other style stays. Records which
    linears got which (`float8`, `plain`: reason -> paths)."""

    def __init__(self, float8_collectives: bool) -> None:
        self.float8_collectives = float8_collectives
        """Whether the TP group's backend carries float8 tensors (NCCL; gloo does not)."""
        self.float8: list[str] = []
        """Paths of the linears under torchao's float8 styles."""
        self.plain: dict[str, list[str]] = {}
        """Why -> paths of the converted linears that keep a plain style."""

    def __call__(self, path: str, module: nn.Module, style: ParallelStyle) -> ParallelStyle:
        replacement = FLOAT8_STYLES.get(type(style))
        if replacement is None or not isinstance(module, Float8Linear):
            return style
        why = plain_reason(module)
        if why is None and not self.float8_collectives and moves_float8(style):
            why = GLOO
        if why is not None:
            self.plain.setdefault(why, []).append(path)
            return style
        self.float8.append(path)
        old: Any = style
        return replacement(input_layouts=old.input_layouts[0], output_layouts=old.output_layouts[0],
                           use_local_output=old.use_local_output)

    def summary(self) -> str:
        """One line: how many linears run under which styles, and why the plain ones do."""
        kept = "; ".join(f"{len(paths)} under the plain styles ({why})" for why, paths in sorted(self.plain.items()))
        return (f"{len(self.float8)} linears under torchao's Float8ColwiseParallel / Float8RowwiseParallel (input cast "
                f"to float8 before its TP collective)" + (f"; {kept}" if kept else ""))


def log_styles(styles: Float8Styles | None, callable_plan: bool) -> None:
    """Say once which TP styles the float8 linears run under (nothing without tensor parallelism)."""
    if callable_plan:
        LOG.info("float8 tensor parallelism: the tp_plan is a callable and applies its own styles (torch's plain ones "
                 "gather activations in high precision; torchao's float8 styles where it names them)")
    elif styles is not None:
        LOG.info("float8 tensor parallelism: %s", styles.summary())
