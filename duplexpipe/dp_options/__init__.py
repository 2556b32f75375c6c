"""The data-parallel settings the trainer accepts (gradient compression methods, ZeRO stages and the pairs it
refuses), torch-free: the trainer checks them and the planner enumerates them from the same table."""

from duplexpipe.dp_options.compression import (
    METHOD_NAMES,
    SHARDED_METHODS,
    Bf16Options,
    DGCOptions,
    Fp16Options,
    GradientWire,
    Int8Options,
    NoCompression,
    Options,
    PowerSGDOptions,
    RandomKOptions,
    ThresholdOptions,
    TopKOptions,
    check_sharded,
    compression_options,
    options_label,
)
from duplexpipe.dp_options.zero import (
    ZERO_STAGES,
    ZeroOptions,
    check_zero,
    check_zero_stage,
    gradient_wire,
    zero_refusal,
)

__all__ = [
    "METHOD_NAMES", "SHARDED_METHODS", "ZERO_STAGES", "Bf16Options", "DGCOptions", "Fp16Options", "GradientWire",
    "Int8Options", "NoCompression", "Options", "PowerSGDOptions", "RandomKOptions", "ThresholdOptions", "TopKOptions",
    "ZeroOptions", "check_sharded", "check_zero", "check_zero_stage", "compression_options", "gradient_wire",
    "options_label", "zero_refusal",
]
