"""A small float32 GPT with float8 (emulated) linears, pipelined on 4 gloo ranks, and torchao's own single-process
float8 training of the same model on the same microbatches, for the float8 exactness tests."""

from __future__ import annotations

import dataclasses
from collections import OrderedDict
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from _comm_cases import WireRoundTrip
from models import shared_folder
from torch import Tensor, nn
from torch.distributed.tensor import DTensor

from duplexpipe import Pipeline, PipelineConfig, make_mesh
from duplexpipe.comm.p2p_codecs import p2p_codec_pair
from duplexpipe.launch.tasks.gpt import GPTConfig, build_gpt, gpt_tp_plan
from duplexpipe.model.stages import inner_module
from duplexpipe.train.float8 import float8_linears
from duplexpipe.train.pipeline_config import DataParallelConfig, PrecisionConfig

VOCAB, SEQ, ROWS, MICRO, STEPS = 16, 8, 16, 8, 2
"""Vocabulary, sequence length, rows per step (over all replicas), microbatches per replica, optimizer steps."""
CONFIG = GPTConfig(vocab_size=VOCAB, block_size=SEQ, d_model=16, n_head=4, n_layer=8)
"""Every block's linears are 16 wide (or 64): all of them convert; the head (16 x 16) stays in high precision."""
SCHEDULES = ("1f1b", "zb-h1", "zbv", "dualpipev")


def loss_fn(logits: Tensor, targets: Tensor) -> Tensor:
    """Token cross entropy."""
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def sgd(params: list[nn.Parameter]) -> torch.optim.Optimizer:
    """The tests' optimizer: SGD with momentum, whose update is linear in the gradient (Adam's first steps divide
    tiny gradients by their own size, so fp32's rounding in another summation order (TP's partial sums, DP's
    reduction) would show at 1e-5 whatever the float8 compute does)."""
    return torch.optim.SGD(params, lr=0.05, momentum=0.9)


def gpt(mixed: bool = False) -> tuple[nn.Module, list[nn.Module], nn.Module]:
    """(embedding, blocks, head) in float32; `mixed`: the linears of every other block (the even ones) have no bias,
    as Llama's."""
    embedding, blocks, head = build_gpt(CONFIG, seed=0)
    if mixed:
        for linear in (m for block in blocks[::2] for m in block.modules() if isinstance(m, nn.Linear)):
            linear.register_parameter("bias", None)
    return embedding, blocks, head


def batch(step: int) -> tuple[Tensor, Tensor]:
    """The global batch of `step`."""
    gen = torch.Generator().manual_seed(100 + step)
    return (torch.randint(0, VOCAB, (ROWS, SEQ), generator=gen), torch.randint(0, VOCAB, (ROWS, SEQ), generator=gen))


def torchao_filter(module: nn.Module, fqn: str) -> bool:
    """torchtitan's rule, written out for the reference: dimensions divisible by 16, the head kept."""
    assert isinstance(module, nn.Linear)
    return "head" not in fqn.split(".") and module.in_features % 16 == 0 and module.out_features % 16 == 0


class Reference:
    """The model in one process (children named as a Pipeline's parts name them), converted by torchao's own
    `convert_to_float8_training` and trained on the pipelines' microbatches (each replica's rows, in order):
    `params[step]` holds every parameter after that step. `sends`: (a p2p_compression label, the children after
    which a message goes to another rank): the label's round trips there, the activation forward and its gradient
    backward, as a pipeline with those compressed sends makes them."""

    def __init__(self, recipe: str = "tensorwise", replicas: int = 1, mixed: bool = False,
                 sends: tuple[str, list[str]] | None = None) -> None:
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training

        embedding, blocks, head = gpt(mixed)
        children = [("embedding", embedding), *((f"layer{i}", b) for i, b in enumerate(blocks)), ("head", head)]
        model = nn.Sequential(OrderedDict(children))
        config = dataclasses.replace(Float8LinearConfig.from_recipe_name(recipe), emulate=True)
        convert_to_float8_training(model, config=config, module_filter_fn=torchao_filter)
        optimizer = sgd(list(model.parameters()))
        self.params: list[dict[str, Tensor]] = []
        count = replicas * MICRO
        for step in range(STEPS):
            x, y = batch(step)
            optimizer.zero_grad()
            for xs, ys in zip(x.chunk(count), y.chunk(count), strict=True):
                (loss_fn(_forward(model, xs, sends), ys) / count).backward()
            optimizer.step()
            self.params.append({n: p.detach().clone() for n, p in model.named_parameters()})


def _forward(model: nn.Sequential, x: Tensor, sends: tuple[str, list[str]] | None) -> Tensor:
    """The model's forward, with the round trips of `sends` (Reference) after the children it names."""
    if sends is None:
        return model(x)  # type: ignore[no-any-return]
    act, grad = p2p_codec_pair(sends[0])
    for name, child in model.named_children():
        x = child(x)
        if name in sends[1]:
            x = WireRoundTrip.apply(x, act, grad)
    return x


def stage_ends(pipe: Pipeline) -> list[str]:
    """The children after which `pipe`'s messages go to another rank (every stage's last child but the model's
    last; a PP-only pipeline, one stage per rank: gathered over the world)."""
    mine = [list(dict(inner_module(m).named_children()))[-1] for m in pipe.stage_modules.values()]
    everyone: list[list[str]] = [[] for _ in range(dist.get_world_size())]
    dist.all_gather_object(everyone, mine)
    return [name for names in everyone for name in names if name != "head"]


def _full(tensor: Tensor) -> Tensor:
    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def compare(pipe: Pipeline, want: dict[str, Tensor]) -> float:
    """Largest relative difference (max |diff| / max |want|, per tensor) of any local parameter from the reference."""
    worst = 0.0
    for module in pipe.stage_modules.values():
        for name, tensor in inner_module(module).named_parameters():
            got, ref = _full(tensor.detach()), want[name]
            worst = max(worst, float((got - ref).abs().max()) / max(float(ref.abs().max()), 1e-30))
    return worst


def run(pipe: Pipeline, ref: Reference) -> dict[str, Any]:
    """Each step's largest parameter difference from torchao's single-process training, and how many float8 linears
    this rank's stages hold."""
    groups, errors = pipe.groups, []
    for step in range(STEPS):
        x, y = (t.chunk(groups.dp_size)[groups.dp_rank] for t in batch(step))
        pipe.step(x, y)
        errors.append(compare(pipe, ref.params[step]))
    from duplexpipe.train.float8_tp import Float8Styles

    out: dict[str, Any] = {"errors": errors, "float8": len(float8_linears(pipe.stage_modules.values()))}
    styles = pipe.tensor.restyle
    if isinstance(styles, Float8Styles):  # which TP styles the float8 linears got
        out["styles"] = {"float8": len(styles.float8), **{why: len(paths) for why, paths in styles.plain.items()}}
    return out


def build(schedule: str, mesh: tuple[int, int, int], *, recipe: str | None = "tensorwise", zero_stage: int = 0,
          mixed: bool = False, sends: str | None = None, **fields: Any) -> Pipeline:
    """The GPT pipelined on a make_mesh(pp, dp, tp=tp) mesh with float8 `recipe` (emulated) and stage sends
    compressed by `sends` (a p2p_compression label)."""
    pp, dp, tp = mesh
    embedding, blocks, head = gpt(mixed)
    config = PipelineConfig(schedule, MICRO, precision=PrecisionConfig(float8=recipe, p2p_compression=sends),
                            data_parallel=DataParallelConfig(zero_stage=zero_stage), **fields)
    plan = gpt_tp_plan(config.sequence_parallel) if tp > 1 else None
    return Pipeline.from_layers(blocks, loss_fn, sgd, config, embedding=embedding, head=head,
                                mesh=make_mesh(pp, dp, tp=tp), tp_plan=plan)


def styles_on_a_biased_block(pipe: Pipeline) -> dict[str, float]:
    """torchao's float8 styles forced on every linear of one GPT block with biases over `pipe`'s TP group, against the
    same block converted by torchao in one process, after one backward: the largest relative gradient difference
    of its weights (and the input) and of its biases. The styles cast the output gradient before the bias gradient
    is summed from it; the single process sums the high-precision one."""
    from torch.distributed.tensor.parallel import parallelize_module
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training
    from torchao.float8.float8_tensor_parallel import Float8ColwiseParallel, Float8RowwiseParallel

    config = dataclasses.replace(Float8LinearConfig.from_recipe_name("tensorwise"), emulate=True)
    ref = convert_to_float8_training(gpt()[1][0], config=config)
    tp = convert_to_float8_training(gpt()[1][0], config=config)
    col, row = Float8ColwiseParallel, Float8RowwiseParallel
    parallelize_module(tp, pipe.groups.tp_mesh, {"attn.q": col(), "attn.k": col(), "attn.v": col(),
                                                 "attn.proj": row(), "mlp.0": col(), "mlp.2": row()})
    x = torch.randn(4, SEQ, CONFIG.d_model, generator=torch.Generator().manual_seed(1))
    grad = torch.randn(4, SEQ, CONFIG.d_model, generator=torch.Generator().manual_seed(2))
    inputs = [x.clone().requires_grad_() for _ in range(2)]
    for model, inp in zip((ref, tp), inputs, strict=True):
        model(inp).backward(grad)
    worst = {"weights": _rel(inputs[1].grad, inputs[0].grad), "biases": 0.0}
    for (name, mine), want in zip(tp.named_parameters(), ref.parameters(), strict=True):
        kind = "biases" if name.endswith("bias") else "weights"
        worst[kind] = max(worst[kind], _rel(_full(mine.grad), want.grad))
    return worst


def _rel(got: Tensor | None, want: Tensor | None) -> float:
    assert got is not None and want is not None
    return float((got - want).abs().max()) / max(float(want.abs().max()), 1e-30)


def gathered(pipe: Pipeline) -> list[str]:
    """The dtypes in which this rank's ZeRO-3 stages gather their float8 linears' weights (each stage gathered once
    by hand, then freed again): the float8 payload's dtype where the weight arrives as torchao's float8 tensor."""
    dtypes = set()
    for module in pipe.stage_modules.values():
        module.unshard()  # type: ignore[operator]
        dtypes |= {str(getattr(m.weight, "_data", m.weight).dtype) for m in float8_linears([module])}
        module.reshard()  # type: ignore[operator]
    return sorted(dtypes)


def resume(pipe: Pipeline, root: str) -> dict[str, Any]:
    """Save `pipe` (float8 on, trained), load the checkpoint into a pipeline with float8 off (its parameters equal the
    saved ones) and into one with float8 on, which then takes the next step as `pipe` takes it (bit-equal)."""
    path = f"{root}/float8"
    pipe.save(path)
    off = build("1f1b", (dist.get_world_size(), 1, 1), recipe=None)
    off.load(path)
    saved = {n: t.detach().clone() for m in pipe.stage_modules.values() for n, t in inner_module(m).named_parameters()}
    loaded_off = max(compare(off, saved), 0.0)
    on = build("1f1b", (dist.get_world_size(), 1, 1))
    on.load(path)
    for p in (pipe, on):
        p.step(*batch(STEPS))
    after = {n: t.detach() for m in pipe.stage_modules.values() for n, t in inner_module(m).named_parameters()}
    return {"off": loaded_off, "on": compare(on, after), "names": sorted(saved) == sorted(
        n for m in off.stage_modules.values() for n, _ in inner_module(m).named_parameters())}


def case(rank: int, world: int) -> dict[str, Any]:
    """PP=4 under every schedule of SCHEDULES, and ZB-H1 with activation checkpointing, compiled (aot_eager) and with
    fp8 stage sends; PP=2 x TP=2 under ZB-H1 and 1F1B with sequence parallelism (blocks with biases: the plain TP
    styles; without: torchao's float8 styles); torchao's styles forced on a biased block; PP=2 x DP=2 under ZB-H1
    with ZeRO-2 and 1F1B with ZeRO-3 (weights all-gathered in float8); a checkpoint of the float8 1F1B run resumed
    with float8 off and on."""
    ref = Reference()
    pipes = {name: build(name, (world, 1, 1)) for name in SCHEDULES}
    out: dict[str, Any] = {name: run(pipe, ref) for name, pipe in pipes.items()}
    out["zb-h1 checkpointed"] = run(build("zb-h1", (world, 1, 1), activation_checkpointing=True), ref)
    out["zb-h1 compiled"] = run(build("zb-h1", (world, 1, 1), compile={"backend": "aot_eager"}), ref)
    compressed = build("zb-h1", (world, 1, 1), sends="fp8")
    out["fp8 sends"] = run(compressed, Reference(sends=("fp8", stage_ends(compressed))))
    mixed = Reference(mixed=True)  # blocks with and without biases: the plain and the float8 TP styles
    out["tp"] = run(tp := build("zb-h1", (2, 1, 2), mixed=True), mixed)
    out["tp sequence parallel"] = run(build("1f1b", (2, 1, 2), mixed=True, sequence_parallel=True), mixed)
    out["biased block"] = styles_on_a_biased_block(tp)
    replicated = Reference(replicas=2)
    out["zero2"] = run(build("zb-h1", (2, 2, 1), zero_stage=2), replicated)
    zero3 = build("1f1b", (2, 2, 1), zero_stage=3)  # float8 all-gathers: the default under ZeRO-3 (tensorwise)
    out["zero3"] = {**run(zero3, replicated), "gathered": gathered(zero3)}
    with shared_folder("float8-") as root:
        out["resume"] = resume(pipes["1f1b"], root)
    return out
