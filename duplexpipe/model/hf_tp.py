"""Tensor-parallel plans of Hugging Face parts: the plan transformers publishes for a model, mapped to torch styles."""

from __future__ import annotations

from collections.abc import Sequence

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Placement, Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from duplexpipe.model.hf import CausalLMPart, LlamaLayoutPart
from duplexpipe.moe.layer import MoELayer
from duplexpipe.tp.plans import plan_errors, resolve, summary
from duplexpipe.tp.style import ReplicatedWithGradAllReduce

SEQUENCE_PARALLEL_NORMS = ("layers.*.input_layernorm", "layers.*.post_attention_layernorm", "norm")
"""The Llama layout's norms: with sequence parallelism they run on the sequence shard (torch's SequenceParallel)."""


def _style(kind: str, key: str, sp: bool) -> ParallelStyle:
    """The torch style of a transformers plan entry (`kind`, e.g. "colwise") for the module `key`."""
    rest: Placement = Shard(1) if sp else Replicate()
    if kind == "colwise":
        return ColwiseParallel()
    if kind == "rowwise":  # ends a TP region on the residual stream: reduce-scatter onto the sequence with SP
        return RowwiseParallel(output_layouts=rest)
    if kind == "colwise_gather_output":  # the head: logits gathered whole on every TP rank
        return ColwiseParallel(input_layouts=rest, output_layouts=Replicate())
    if kind == "embedding_rowwise":  # vocabulary-parallel embedding
        return RowwiseParallel(input_layouts=Replicate(), output_layouts=rest)
    if kind == "replicated_with_grad_allreduce":  # e.g. Qwen3's q_norm / k_norm over the local heads
        return ReplicatedWithGradAllReduce()
    raise ValueError(f"the published tensor-parallel plan of this model shards {key!r} as {kind!r}, which "
                     "duplexpipe does not map to a torch style (supported: colwise, rowwise, colwise_gather_output, "
                     "embedding_rowwise, replicated_with_grad_allreduce)")


def published_plan(part: CausalLMPart) -> dict[str, str]:
    """The plan transformers publishes for the part's model, keyed like the part's own modules (`layers.*.mlp.up_proj`,
    `embed_tokens`, `lm_head`): the model class's `_tp_plan` (head, embedding) and `config.base_model_tp_plan`."""
    if not isinstance(part, LlamaLayoutPart):
        raise ValueError(f"{part.model_class} has no tensor-parallel plan: transformers publishes none for it "
                         "(config.base_model_tp_plan is None) and GPT-2's attention packs q, k and v into one Conv1D "
                         "weight (c_attn), which a column split would cut across q, k and v; train it with tp=1")
    base = dict(getattr(part.config, "base_model_tp_plan", None) or {})
    if not base:
        raise ValueError(f"{part.model_class}'s config publishes no base_model_tp_plan; pass tp_plan= yourself")
    head = {"embed_tokens": "embedding_rowwise", "lm_head": "colwise_gather_output"}
    return {**head, **base}


def part_plan(part: CausalLMPart, sequence_parallel: bool) -> dict[str, ParallelStyle]:
    """The torch plan of one Hugging Face part: the published plan mapped (`published_plan`), and with sequence
    parallelism the norms on the sequence shard and an all-gather before each attention and MLP (torchtitan's
    Llama plan); only the keys this part has. An MoE family's sparse blocks (`MoELayer`s) stay whole, as
    `moe_tp_plan` leaves them: their experts are spread by expert parallelism, so the published entries inside them
    are left out; with sequence parallelism they are refused (they would see the whole sequence)."""
    moe = [path for path, module in part.named_modules() if isinstance(module, MoELayer)]
    if moe and sequence_parallel:
        raise ValueError(f"sequence parallelism: {part.model_class}'s sparse blocks run whole on every TP rank (their "
                         "experts are spread by expert parallelism, not TP), which needs the whole sequence; use "
                         "tensor parallelism without sequence_parallel")
    published = {key: kind for key, kind in published_plan(part).items() if _outside(part, key, moe)}
    plan = {key: _style(kind, key, sequence_parallel) for key, kind in published.items()}
    if sequence_parallel:
        for norm in SEQUENCE_PARALLEL_NORMS:
            plan[norm] = SequenceParallel(use_local_output=True)
        plan["layers.*.self_attn"] = PrepareModuleInput(
            input_kwarg_layouts={"hidden_states": Shard(1)}, desired_input_kwarg_layouts={"hidden_states": Replicate()},
            use_local_output=True)
        plan["layers.*.mlp"] = PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),),
                                                  use_local_output=True)
    return {key: style for key, style in plan.items() if any(True for _ in resolve(part, key))}


def _outside(part: nn.Module, key: str, moe: Sequence[str]) -> bool:
    """Whether a plan key names modules of `part` none of which lies inside the MoE layers at paths `moe`."""
    paths = [path for path, _ in resolve(part, key)]
    return bool(paths) and not any(p == m or p.startswith(m + ".") for p in paths for m in moe)


class HFTensorPlan:
    """The tensor-parallel plan `Pipeline.from_pretrained` applies to Hugging Face parts (a `CheckedPlan`)."""

    def __init__(self, sequence_parallel: bool = False) -> None:
        self.sequence_parallel = sequence_parallel
        """Whether the plan shards the sequence between TP regions and across stages."""

    def check(self, parts: Sequence[nn.Module], tp: int) -> None:
        """ValueError naming module, size and degree when `tp` cannot shard the model: the attention heads and KV
        heads, and every dimension the plan shards."""
        errors: list[str] = []
        for k, module in enumerate(parts):
            part = _hf_part(module, f"part {k}")
            config = part.config
            for name in ("num_attention_heads", "num_key_value_heads"):
                value = getattr(config, name, None)
                if isinstance(value, int) and value % tp:
                    errors.append(f"module 'layers.*.self_attn' ({part.model_class}) has {name}={value}, not "
                                  f"divisible by the TP degree {tp}")
            errors += plan_errors([part], part_plan(part, self.sequence_parallel), tp, first_part=k)[1]
        if errors:
            raise ValueError("the model cannot be tensor-parallel: " + summary(list(dict.fromkeys(errors))))

    def styles(self, part: nn.Module) -> dict[str, ParallelStyle]:
        """{module path: style} this plan gives `part` (what the planner's `tp.facts` counts)."""
        return {path: style for key, style in part_plan(_hf_part(part), self.sequence_parallel).items()
                for path, _ in resolve(part, key)}

    def __call__(self, part: nn.Module, tp_mesh: DeviceMesh) -> None:
        """Shard one Hugging Face part over `tp_mesh` (its masks and positions then cover the whole sequence)."""
        plan = part_plan(_hf_part(part), self.sequence_parallel)
        if plan:
            parallelize_module(part, tp_mesh, plan, src_data_rank=None)


def _hf_part(part: nn.Module, what: str = "the part") -> CausalLMPart:
    """`part`, which must be a Hugging Face part (ValueError naming `what` and its type otherwise)."""
    if not isinstance(part, CausalLMPart):
        raise ValueError(f"the Hugging Face tensor-parallel plan needs Hugging Face parts; {what} is a "
                         f"{type(part).__name__}")
    return part
