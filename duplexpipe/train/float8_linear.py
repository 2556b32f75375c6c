"""torchao's Float8Linear with a split backward: d(input) at I and d(weight) at W, each GEMM with torchao's casts."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor
from torch.autograd.graph import get_gradient_edge
from torchao.float8.config import ScalingType
from torchao.float8.distributed_utils import tensor_already_casted_to_fp8
from torchao.float8.float8_linear import Float8Linear, matmul_with_hp_or_float8_args
from torchao.float8.float8_scaling_utils import get_maybe_axiswise_dim, hp_tensor_to_float8_dynamic
from torchao.float8.float8_training_tensor import GemmInputRole

from duplexpipe.runtime.backward.mode import BackwardMode, input_wanted, take_mode


def _cast(tensor: Tensor, cast: Any, ctx: Any, role: GemmInputRole, axis: int) -> Tensor:
    """`tensor` cast to float8 as torchao's backward casts it for one GEMM operand (as is when already float8 or
    when the recipe leaves that operand in high precision)."""
    if tensor_already_casted_to_fp8(tensor) or cast.scaling_type is ScalingType.DISABLED:
        return tensor
    out: Tensor = hp_tensor_to_float8_dynamic(
        tensor, cast.target_dtype, ctx.linear_mm_config, gemm_input_role=role,
        scaling_granularity=cast.scaling_granularity,
        axiswise_dim=get_maybe_axiswise_dim(axis, cast.scaling_granularity),
        round_scales_to_power_of_2=ctx.config.round_scales_to_power_of_2)
    return out


def grad_input(ctx: Any, grad: Tensor, weight_t: Tensor) -> Tensor:
    """d(input) of the 2-D output gradient `grad`: torchao's grad_input GEMM with its casts."""
    c = ctx.config
    out = _cast(grad, c.cast_config_grad_output, ctx, GemmInputRole.GRAD_OUTPUT, -1)
    weight = _cast(weight_t, c.cast_config_weight_for_grad_input, ctx, GemmInputRole.WEIGHT, -1)
    return torch.mm(out, weight.t())


def grad_weight(ctx: Any, grad: Tensor, inputs: Tensor) -> Tensor:
    """d(weight.t()) of the 2-D output gradient `grad` and the 2-D inputs: torchao's grad_weight GEMM with its casts."""
    c = ctx.config
    out = _cast(grad, c.cast_config_grad_output_for_grad_weight, ctx, GemmInputRole.GRAD_OUTPUT, 0)
    rows = _cast(inputs, c.cast_config_input_for_grad_weight, ctx, GemmInputRole.INPUT, 0)
    return torch.mm(out.t(), rows).t()


class SplitFloat8Matmul(matmul_with_hp_or_float8_args):
    """torchao's float8 matmul: its forward, and a backward that forms d(input) at I, d(weight) at W, both at B."""

    splits_backward = True
    """Its backward reads its node's mark (`runtime.backward.mode.SPLITS_BACKWARD`)."""

    @staticmethod
    def forward(ctx: Any, input_hp: Tensor, weight_hp_t: Tensor, mm_config: Any, config: Any) -> Tensor:
        ctx.x_node = get_gradient_edge(input_hp).node if input_hp.requires_grad else None  # a leaf's too
        out: Tensor = matmul_with_hp_or_float8_args.forward(ctx, input_hp, weight_hp_t, mm_config, config)
        return out

    @staticmethod
    def backward(ctx: Any, grad_output: Tensor) -> tuple[Tensor | None, ...]:  # type: ignore[override]
        input_hp, weight_hp_t = ctx.saved_tensors
        mode = take_mode(ctx)  # the node: ctx is the autograd node of a Function
        grad = grad_output.reshape(-1, grad_output.shape[-1])
        d_input = d_weight = None
        if ctx.needs_input_grad[0] and input_wanted(mode, ctx.x_node):
            d_input = grad_input(ctx, grad, weight_hp_t).reshape(*grad_output.shape[:-1], -1)
        if ctx.needs_input_grad[1] and mode is not BackwardMode.INPUTS:
            d_weight = grad_weight(ctx, grad, input_hp.reshape(-1, input_hp.shape[-1]))
        return d_input, d_weight, None, None


class SplitFloat8Linear(Float8Linear):
    """torchao's Float8Linear (same parameters, config and forward) computing through `SplitFloat8Matmul`."""

    def forward(self, input: Tensor) -> Tensor:  # noqa: A002 - torch's name
        if torch.is_autocast_enabled():  # as Float8Linear: the output in the autocast dtype
            input = input.to(torch.get_autocast_gpu_dtype())
        output: Tensor = SplitFloat8Matmul.apply(input, self.weight.t(), self.linear_mm_config, self.config)
        if self.bias is not None:
            output = output + self.bias.to(output.dtype)
        return output
