"""PipelineConfig.compile: options checked before training (one ValueError naming what torch rejects), what is
compiled in a stage (layers of from_layers parts, a part's own blocks, the pieces around MoE layers, whole parts,
nothing the user compiled), the backend a split backward gets, and the log of compiles and recompiles."""

from __future__ import annotations

import importlib.util
import logging
import time

import pytest
import torch
from models import Block, run_workers
from torch import nn

from duplexpipe import Pipeline, PipelineConfig
from duplexpipe.errors import PeerFailedError, PipelineTimeoutError
from duplexpipe.model.split import build_parts, plan_partition
from duplexpipe.model.stages import CheckpointedStage
from duplexpipe.moe import CausalSelfAttention, MoEBlock, MoELayer
from duplexpipe.runtime.backward import compat
from duplexpipe.runtime.backward.compiled import SplitBackend
from duplexpipe.runtime.watchdog import Watchdog
from duplexpipe.schedules.registry import build
from duplexpipe.train.compile import (
    CompiledStages,
    check_usable,
    compile_options,
    compile_targets,
    splits_backward,
    torch_compile_kwargs,
    uses_cuda_graphs,
)
from duplexpipe.train.pipeline_config import SafetyConfig

DIM = 8


def test_true_false_and_dicts_become_torch_compile_options() -> None:
    assert compile_options(False) is None and compile_options(None) is None
    assert compile_options(True) == {}
    given = {"backend": "aot_eager", "dynamic": False, "fullgraph": True}
    assert compile_options(given) == given
    assert compile_options({"mode": "max-autotune-no-cudagraphs"}) == {"mode": "max-autotune-no-cudagraphs"}


@pytest.mark.parametrize(("value", "says"), [
    ({"backend": "nope"}, "Invalid backend: 'nope'"),
    ({"mode": "fastest"}, "Unrecognized mode=fastest"),
    ({"options": {"no_such_option": 1}}, "Unexpected optimization option no_such_option"),
    ({"options": {"max_autotune": "yes"}}, "Unexpected type of attr max_autotune"),
    ({"mode": "max-autotune", "options": {"max_autotune": True}}, "Either mode or options"),
    ({"backend": "aot_eager", "mode": "max-autotune"}, "mode and options are inductor's"),
    ({"dynamic": "yes"}, r"\['dynamic'\] must be True, False or None"),
    ({"fullgraph": 1}, r"\['fullgraph'\] must be True or False"),
    ({"backend": 3}, r"\['backend'\] must be a backend name or a callable"),
    ({"compile_threads": 4}, r"got unknown \['compile_threads'\]"),
    ("inductor", "must be True/False or a dict"),
])
def test_options_torch_rejects_raise_one_value_error(value: object, says: str) -> None:
    with pytest.raises(ValueError, match=says):
        PipelineConfig(compile=value)  # type: ignore[arg-type]


@pytest.mark.skipif(importlib.util.find_spec("tvm") is not None, reason="tvm is installed here")
def test_a_backend_whose_package_is_missing_is_named() -> None:
    with pytest.raises(ValueError, match="backend 'tvm' needs the package 'tvm', which is not installed"):
        compile_options({"backend": "tvm"})


def test_cuda_graphs_need_a_gpu_and_a_whole_backward(monkeypatch: pytest.MonkeyPatch) -> None:
    graphs = {"mode": "reduce-overhead"}
    assert uses_cuda_graphs(graphs) and not uses_cuda_graphs({"mode": "max-autotune-no-cudagraphs"})
    with pytest.raises(ValueError, match="need a GPU"):
        check_usable(graphs, torch.device("cpu"), split=False)
    monkeypatch.setattr(compat, "has_triton", lambda: True)
    check_usable(graphs, torch.device("cuda"), split=False)
    with pytest.raises(ValueError, match="runs it in two parts"):
        check_usable(graphs, torch.device("cuda"), split=True)


def test_inductor_on_a_gpu_needs_triton(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(compat, "has_triton", lambda: False)
    with pytest.raises(ValueError, match="needs triton"):
        check_usable({}, torch.device("cuda"), split=False)


def _moe_block() -> MoEBlock:
    return MoEBlock(DIM, MoELayer(DIM, 12, 4, 2, shared_experts=1), mixer=CausalSelfAttention(DIM, 2))


def test_from_layers_parts_compile_their_layers_and_moe_blocks_the_pieces_around_the_experts() -> None:
    moe = _moe_block()
    layers: list[nn.Module] = [Block(DIM), moe, Block(DIM)]
    embedding, head = nn.Embedding(5, DIM), nn.Linear(DIM, 5)
    partition = plan_partition(layers, 2, (2, 1), embedding=embedding, head=head)
    parts = build_parts(layers, partition, embedding=embedding, head=head)
    first = compile_targets(CheckpointedStage(parts[0]))  # a checkpointing wrapper is looked through
    assert [m for m, _ in first] == [layers[0], moe.mixer, moe.norm1, moe.norm2, moe.moe.router]
    assert [in_moe for _, in_moe in first] == [False, True, True, True, True]
    assert [m for m, _ in compile_targets(parts[1])] == [layers[2]]


class _Declares(nn.Module):
    """A part naming its own blocks (as Hugging Face parts name their decoder layers)."""

    def __init__(self) -> None:
        super().__init__()
        self.first, self.second = Block(DIM), Block(DIM)

    def compile_blocks(self) -> list[nn.Module]:
        return [self.second]


def test_parts_compile_their_declared_blocks_else_whole_and_user_compiled_parts_not_at_all() -> None:
    declared = _Declares()
    assert [m for m, _ in compile_targets(declared)] == [declared.second]
    whole = nn.Sequential(Block(DIM), Block(DIM))
    assert [m for m, _ in compile_targets(whole)] == [whole]
    assert compile_targets(torch.compile(whole, backend="aot_eager")) == []
    inner = nn.Sequential(Block(DIM), Block(DIM))
    inner[1].compile(backend="aot_eager")
    assert compile_targets(inner) == []


def test_a_split_backward_gets_the_splitting_backend() -> None:
    assert splits_backward(build("zb-h1", 2, 4)) and splits_backward(build("dualpipev", 2, 4))
    assert not splits_backward(build("1f1b", 2, 4)) and not splits_backward(build("interleaved-1f1b", 2, 4))
    plain = torch_compile_kwargs({"backend": "aot_eager", "fullgraph": True}, split=False, moe=False)
    assert plain == {"backend": "aot_eager", "fullgraph": True}
    split = torch_compile_kwargs({"mode": "max-autotune-no-cudagraphs", "dynamic": True}, split=True, moe=True)
    assert split["backend"] == SplitBackend("inductor", "max-autotune-no-cudagraphs", None, True)
    assert split["fullgraph"] is False and "mode" not in split
    custom = torch_compile_kwargs({"backend": "eager"}, split=True, moe=False)
    assert custom == {"backend": "eager"}  # not one it can split: its regions run their backward whole at I


def test_the_log_says_what_compiles_first_and_each_recompilation_once(caplog: pytest.LogCaptureFixture) -> None:
    torch._dynamo.reset()  # forget the sizes earlier tests compiled Block for (else the first graph is dynamic)
    torch.manual_seed(0)
    modules = {0: nn.Sequential(Block(DIM), Block(DIM)).double()}
    stages = CompiledStages(modules, {"backend": "aot_eager"}, build("1f1b", 2, 4), torch.device("cpu"))
    assert stages.modules == 1 and "1 modules with aot_eager" in stages.describe()
    caplog.set_level(logging.INFO, logger="duplexpipe.compile")
    for rows in (4, 4, 3, 3, 5):
        with stages.watching(f"step rows={rows}"):
            modules[0](torch.randn(rows, DIM, dtype=torch.float64, requires_grad=True)).sum().backward()
    lines = [r.getMessage() for r in caplog.records]
    assert lines[0].startswith("compiling 1 modules with aot_eager on the first step")
    assert lines[1].startswith("step rows=4: compiled ")
    assert len(lines) == 3 and lines[2].startswith("step rows=3 recompiled 1 graphs in ")
    assert "size mismatch" in lines[2]  # dynamo's reason; the next sizes reuse the dynamic graph


def test_a_first_evaluation_is_said_to_compile_before_and_after(caplog: pytest.LogCaptureFixture) -> None:
    """What `duplexpipe train --compile --eval-every N` prints around its first evaluation (report_to): that it
    compiles again and why, before it starts, and then what compiled, for how long and dynamo's reason."""
    torch._dynamo.reset()
    block = nn.Sequential(Block(DIM)).double()
    stages = CompiledStages({0: block}, {"backend": "aot_eager"}, build("1f1b", 2, 4), torch.device("cpu"))
    lines: list[tuple[str, str, bool]] = []
    stages.report_to(lambda what, text, routine: lines.append((what, text, routine)))
    x = torch.randn(4, DIM, dtype=torch.float64, requires_grad=True)
    with stages.watching("step 1"):
        block(x).sum().backward()
    with torch.no_grad(), stages.watching("evaluate"):
        block.eval()
        block(x)
    assert not [r for r in caplog.records if r.name == "duplexpipe.compile"], "reported, not logged"
    assert [(what, routine) for what, _, routine in lines] == [("", True), ("step 1", True), ("evaluate", True),
                                                                ("evaluate", True)]
    assert lines[2][1].startswith(": the first evaluation runs the compiled blocks without gradients")
    assert lines[3][1].startswith(" recompiled ") and " graphs in " in lines[3][1]
    assert "grad" in lines[3][1].lower() or "training" in lines[3][1], lines[3]  # dynamo's reason, not a guess


def test_nothing_compiled_logs_nothing(caplog: pytest.LogCaptureFixture) -> None:
    stages = CompiledStages({0: Block(DIM)}, None, build("1f1b", 2, 4), torch.device("cpu"))
    caplog.set_level(logging.INFO, logger="duplexpipe.compile")
    with stages.watching("step 0"):
        pass
    assert not stages.active and not caplog.records


def test_parts_compiled_in_place_are_said_to_run_eager(caplog: pytest.LogCaptureFixture) -> None:
    """nn.Module.compile does not survive the copy a stage makes of its part (torch drops it): say so."""
    part = nn.Sequential(Block(DIM))
    part[0].compile(backend="aot_eager")
    CompiledStages({0: nn.Sequential(Block(DIM))}, None, build("1f1b", 2, 4), torch.device("cpu"), [part])
    assert "torch drops when a stage copies its part" in caplog.text


def test_the_first_step_and_evaluation_wait_with_the_compile_bound_then_the_own_bound() -> None:
    watchdog = Watchdog(None, "", 0, timeout_s=2.0, poll_s=0.1)
    stages = CompiledStages({0: nn.Sequential(Block(DIM))}, {"backend": "eager"}, build("1f1b", 2, 4),
                            torch.device("cpu"))
    bounds = []
    for kind in ("step", "step", "evaluate", "evaluate"):
        with stages.patience(kind, watchdog, 60.0):
            bounds.append(watchdog.timeout_s)
    assert bounds == [60.0, 2.0, 60.0, 2.0] and watchdog.timeout_s == 2.0
    with stages.patience("evaluate", watchdog, 60.0), pytest.raises(RuntimeError):
        raise RuntimeError("a failed step")
    assert watchdog.timeout_s == 2.0  # restored after a failure too
    eager = CompiledStages({0: Block(DIM)}, None, build("1f1b", 2, 4), torch.device("cpu"))
    with eager.patience("step", watchdog, 60.0):
        assert watchdog.timeout_s == 2.0  # nothing compiles: the own bound from the first step
    longer = Watchdog(None, "", 0, timeout_s=90.0, poll_s=0.1)
    with longer.patient(60.0):
        assert longer.timeout_s == 90.0  # a shorter compile bound never shortens the own one


class _Slow(nn.Module):
    """Sleeps SLOW_S in its forward on the calls listed (a compile that takes longer than timeout_s)."""

    def __init__(self, calls: tuple[int, ...]) -> None:
        super().__init__()
        self.linear, self.calls, self.seen = nn.Linear(DIM, DIM), calls, 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.seen in self.calls:
            time.sleep(SLOW_S)
        self.seen += 1
        return self.linear(x)


SLOW_S, BOUND_S = 5.0, 2.0


def _slow_first_steps(rank: int, world: int) -> str:
    """2 ranks, 1F1B with 2 microbatches, user-compiled parts, timeout_s=BOUND_S: rank 0's first microbatch forward of
    step 0 and of step 1 sleeps SLOW_S (rank 1 waits that long for it). What each step did."""
    torch.manual_seed(0)
    parts = [torch.compile(p, backend="eager") for p in (_Slow((0, 2)), nn.Linear(DIM, 1))]
    pipe = Pipeline(parts, lambda y, t: ((y - t) ** 2).mean(), lambda ps: torch.optim.SGD(ps, lr=0.1),
                    PipelineConfig("1f1b", 2, safety=SafetyConfig(timeout_s=BOUND_S, compile_timeout_s=60.0)))
    x, t = torch.randn(4, DIM), torch.randn(4, 1)
    results = []
    for _ in range(2):
        try:
            pipe.step(x, t)
            results.append("ok")
        except (PipelineTimeoutError, PeerFailedError) as exc:  # the group is spent after a timeout: stop here
            results.append(type(exc).__name__)
            break
    return " ".join(results)


@pytest.mark.timeout(150)
def test_a_compiling_first_step_outlasts_timeout_s_and_later_steps_do_not() -> None:
    """A first step slower than timeout_s (compiling) trains under compile_timeout_s; the same delay in the second
    step times out, as it should (the unit test above: without compiled stages the first step has no such bound)."""
    results = run_workers(_slow_first_steps, 2, timeout_s=120)
    assert results[1] == "ok PipelineTimeoutError", results
    assert results[0] in ("ok PeerFailedError", "ok PipelineTimeoutError"), results
