"""The precision options of the compute, torch-free: the autocast dtype names, fp16's dynamic loss scaling and
float8's recipe (`train.precision` maps the names to torch dtypes; `train.float8` converts the linears)."""

from __future__ import annotations

import math
from dataclasses import dataclass

from duplexpipe.dp_options.labels import build_options, parse_label

PRECISIONS = ("fp32", "bf16", "fp16")
"""`PrecisionConfig.dtype` values: fp32 (no autocast), bfloat16 or float16 autocast."""
RECIPES = ("tensorwise", "rowwise")
"""The torchao recipes `PrecisionConfig.float8` takes (`Float8LinearConfig.from_recipe_name`)."""


def check_precision(precision: object) -> str:
    """`precision` if it is one of PRECISIONS; ValueError naming it otherwise."""
    if precision not in PRECISIONS:
        raise ValueError(f"unknown precision {precision!r}; expected one of {PRECISIONS}")
    return str(precision)


@dataclass
class LossScaleConfig:
    """Dynamic loss scaling for fp16 (the usual grow-on-success, back-off-on-overflow rule)."""

    init_scale: float = 2.0**16
    """The loss scale of the first step."""
    growth_factor: float = 2.0
    """Multiply the scale by this after `growth_interval` overflow-free optimizer steps in a row."""
    backoff_factor: float = 0.5
    """Multiply the scale by this when a step overflows (the step is skipped on every rank)."""
    growth_interval: int = 2000
    """Overflow-free steps in a row before the scale grows."""
    min_scale: float = 1.0
    """The scale never backs off below this."""

    def __post_init__(self) -> None:
        for name in ("init_scale", "growth_factor", "backoff_factor", "min_scale"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise ValueError(f"LossScaleConfig.{name} must be a finite number, got {value!r}")
        if self.init_scale <= 0 or self.min_scale <= 0:
            raise ValueError(
                f"init_scale and min_scale must be > 0, got {self.init_scale} and {self.min_scale}")
        if self.growth_factor < 1 or not 0 < self.backoff_factor < 1:
            raise ValueError(
                f"need growth_factor >= 1 and 0 < backoff_factor < 1, got {self.growth_factor} "
                f"and {self.backoff_factor}"
            )
        if isinstance(self.growth_interval, bool) or not isinstance(self.growth_interval, int) \
                or self.growth_interval < 1:
            raise ValueError(f"growth_interval must be >= 1, got {self.growth_interval!r} (an int)")


@dataclass(frozen=True)
class Float8Options:
    """Float8 compute: the torchao recipe and whether its GEMMs are emulated."""

    recipe: str = "tensorwise"
    """A torchao recipe: "tensorwise" (one scale per tensor) or "rowwise" (one per row, powers of two)."""
    emulate: bool | None = None
    """True: emulate the FP8 GEMMs in high precision (any device, for tests); False: FP8 hardware is required (a
    ValueError before training without it); None: emulate where the device has no FP8 GEMMs (CPU, CUDA below
    compute capability 8.9), said once in the log."""
    fsdp_all_gather: bool | None = None
    """ZeRO-3 (FSDP2) gathers the converted weights in float8, cast before the all-gather with one scale per weight
    (torchao's `enable_fsdp_float8_all_gather`; the scales are precomputed after each optimizer step, one all-reduce,
    `precompute_float8_dynamic_scale_for_fsdp`): True, False, or None: on under zero_stage=3 with the tensorwise recipe
    (torchao casts only tensorwise weights before the all-gather), as torchtitan's default."""

    def __post_init__(self) -> None:
        if self.recipe not in RECIPES:
            raise ValueError(f"float8 recipe {self.recipe!r} is not one of {RECIPES}")
        for name in ("emulate", "fsdp_all_gather"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, bool):
                raise ValueError(f"float8 {name} must be True, False or None, got {value!r}")
        if self.fsdp_all_gather and self.recipe != "tensorwise":
            raise ValueError(f"float8 fsdp_all_gather=True needs the 'tensorwise' recipe (torchao casts only "
                             f"tensorwise weights before the all-gather), got recipe {self.recipe!r}")

    def all_gathers_float8(self, zero_stage: int) -> bool:
        """Whether ZeRO stage `zero_stage` gathers the converted weights in float8 (only ZeRO-3 gathers weights)."""
        if zero_stage != 3:
            return False
        return self.fsdp_all_gather if self.fsdp_all_gather is not None else self.recipe == "tensorwise"


def float8_options(spec: str | Float8Options | None, what: str = "PrecisionConfig.float8") -> Float8Options | None:
    """Options from a recipe name, its label with options ("rowwise(emulate=true)"), an options object (as is) or
    None (float8 off); ValueError naming the value otherwise."""
    if spec is None or isinstance(spec, Float8Options):
        return spec
    if isinstance(spec, str):
        name, options = parse_label(spec) if "(" in spec else (spec.strip(), {})
        if name in RECIPES:
            return build_options(Float8Options, {"recipe": name, **options}, f"{what}={spec!r}")  # type: ignore[no-any-return]
    raise ValueError(f"{what} must be None, one of {RECIPES} (with options as in 'tensorwise(emulate=true)') or a "
                     f"Float8Options, got {spec!r}")
