"""The one signal of the split backward: the mode marked on an autograd node says which gradients its next run
computes (input gradients now, weight gradients later, or both), for every node that computes them itself.

Most nodes need no signal: `graph.stage_backward_input` asks the engine for the inputs' gradients only, so
autograd skips their weight branches. A node whose single backward computes both (a region compiled by
`compiled.SplitBackend`, an autograd Function declaring `SPLITS_BACKWARD`, such as `moe.linear`'s) reads its
mark instead: `stage_backward_input` marks it INPUTS before I; its run at I computes the input gradients and
leaves it marked WEIGHTS; its run at W (the engine restarted at it) computes the weight gradients and unmarks it.
An unmarked node computes both (B, a full backward). The mark is on the node object, the one thing the engine
hands to whichever thread runs it.
"""

from __future__ import annotations

from enum import Enum
from typing import Any

from duplexpipe.runtime.backward import compat

MODE = "_duplexpipe_mode"
"""The attribute of an autograd node holding its mark."""
SPLITS_BACKWARD = "splits_backward"
"""Set (True) on an autograd Function class, or on a region's compiled backward, whose backward reads its node's
mark (`take_mode`) and computes only the gradients it names."""


class BackwardMode(Enum):
    """Which gradients a node's backward computes on its next run."""

    ALL = "all"
    """B: the inputs' and the weights' gradients."""
    INPUTS = "inputs"
    """I: the inputs' gradients only."""
    WEIGHTS = "weights"
    """W: the weights' gradients (and the inputs' only where the engine still runs the input's node)."""


class NodeKind(Enum):
    """What an autograd node is, for the split backward."""

    EAGER = "eager"
    """A node autograd splits by its edges (any built-in node, any other autograd Function)."""
    SPLIT_FUNCTION = "split function"
    """An eager autograd Function that reads its mark (`SPLITS_BACKWARD`)."""
    SPLIT_REGION = "split region"
    """A region compiled by `compiled.SplitBackend`: its backward runs as an I graph or a W graph, by its mark."""
    UNSPLIT_REGION = "unsplit region"
    """A region compiled otherwise (or whose backward is not compiled yet): its one backward graph computes every
    gradient, so it runs once, at I."""


def node_kind(node: Any) -> NodeKind:
    """What `node` is (`NodeKind`)."""
    function = compat.autograd_function(node)
    if function is None:
        return NodeKind.EAGER
    if compat.is_compiled_region(function):
        compiled = compat.compiled_backward(function)
        return NodeKind.SPLIT_REGION if getattr(compiled, SPLITS_BACKWARD, False) else NodeKind.UNSPLIT_REGION
    return NodeKind.SPLIT_FUNCTION if getattr(function, SPLITS_BACKWARD, False) else NodeKind.EAGER


def set_mode(node: Any, mode: BackwardMode) -> None:
    """Mark which gradients `node`'s next run computes (ALL: unmarked)."""
    setattr(node, MODE, mode)


def mode_of(node: Any) -> BackwardMode:
    """The mark on `node` (ALL when unmarked)."""
    mode: BackwardMode = getattr(node, MODE, BackwardMode.ALL)
    return mode


def take_mode(node: Any) -> BackwardMode:
    """Which gradients this run of `node` computes, moving its mark on: after I it waits for W, after W it is
    unmarked. Called by the node's own backward."""
    mode = mode_of(node)
    if mode is BackwardMode.INPUTS:
        set_mode(node, BackwardMode.WEIGHTS)
    elif mode is BackwardMode.WEIGHTS:
        set_mode(node, BackwardMode.ALL)
    return mode


def input_wanted(mode: BackwardMode, node: Any) -> bool:
    """Whether a node's backward in `mode` forms d(input): not in a split backward's W, unless the engine still runs
    the input's node `node` (asked of the engine; None: a leaf input)."""
    return mode is not BackwardMode.WEIGHTS or node is None or compat.will_engine_execute(node)
