"""State as tensors and plain values (no pickle of our own): nested state <-> a JSON skeleton plus tensors, and a
torch.distributed.checkpoint load planner that reads non-tensor values with torch.load(weights_only=True)."""

from __future__ import annotations

import io
import json
from typing import Any

import torch
from torch.distributed.checkpoint import DefaultLoadPlanner
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.planner import ReadItem

_PLAIN = (str, int, float, bool, type(None))


def encode(state: Any, where: str = "state") -> tuple[str, list[torch.Tensor]]:
    """(JSON skeleton, tensors) of nested dicts (str or int keys), lists, tuples, tensors and plain values."""
    tensors: list[torch.Tensor] = []

    def walk(value: Any, path: str) -> Any:
        if isinstance(value, torch.Tensor):
            tensors.append(value.detach())
            return {"t": len(tensors) - 1}
        if isinstance(value, dict):
            bad = [k for k in value if not isinstance(k, (str, int)) or isinstance(k, bool)]
            if bad:
                raise ValueError(f"{path}: keys must be str or int, got {bad[0]!r}")
            return {"d": [[k, walk(v, f"{path}[{k!r}]")] for k, v in value.items()]}
        if isinstance(value, (list, tuple)):
            items = [walk(v, f"{path}[{i}]") for i, v in enumerate(value)]
            return {"l": items} if isinstance(value, list) else {"u": items}
        if isinstance(value, _PLAIN):
            return {"v": value}
        raise ValueError(f"{path} is a {type(value).__name__}; state must be tensors, plain values, dicts, lists "
                         "and tuples")

    skeleton = walk(state, where)
    return json.dumps(skeleton), tensors


def decode(skeleton: str, tensors: list[torch.Tensor]) -> Any:
    """The nested state `encode` described."""

    def build(node: dict[str, Any]) -> Any:
        (kind, body), = node.items()
        if kind == "t":
            return tensors[int(body)]
        if kind == "d":
            return {k: build(v) for k, v in body}
        if kind == "l":
            return [build(v) for v in body]
        if kind == "u":
            return tuple(build(v) for v in body)
        return body

    return build(json.loads(skeleton))


class WeightsOnlyLoadPlanner(DefaultLoadPlanner):
    """torch.distributed.checkpoint's default load planner, reading non-tensor values with
    `torch.load(weights_only=True)` (plain values only; the default unpickles anything)."""

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        loaded = torch.load(value, weights_only=True)
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], loaded)
        else:
            self.state_dict[read_item.dest_index.fqn] = loaded
