"""Tests for duplexpipe.model.state_names: global checkpoint names from a part's own keys and the modules' hooks."""

from __future__ import annotations

import pytest
from torch import nn

from duplexpipe.model.split import split_model
from duplexpipe.model.state_names import mapped_key, names_whole_model, part_state_keys


class LocalExperts(nn.Module):
    """Experts first..first+n-1 of an expert-parallel layer, held as experts.0..n-1."""

    def __init__(self, first: int, count: int) -> None:
        super().__init__()
        self.first = first
        self.experts = nn.ModuleList(nn.Linear(2, 2) for _ in range(count))
        self.router = nn.Linear(2, count)

    def global_state_key(self, key: str) -> str:
        head, _, rest = key.partition(".")
        if head != "experts":
            return key
        index, _, tail = rest.partition(".")
        return f"experts.{self.first + int(index)}.{tail}"


class NamedPart(nn.Module):
    """A part that names its state in the whole model: everything under `model.`."""

    def __init__(self, first: int) -> None:
        super().__init__()
        self.mlp = LocalExperts(first, 2)

    def global_state_key(self, key: str) -> str:
        return f"model.layers.3.{key}"


def test_hooks_apply_innermost_first() -> None:
    part = NamedPart(first=4)
    assert mapped_key(part, "mlp.experts.1.weight") == "model.layers.3.mlp.experts.5.weight"
    assert mapped_key(part, "mlp.router.bias") == "model.layers.3.mlp.router.bias"
    keys = part_state_keys(part, 7)
    assert keys["mlp.experts.0.bias"] == "model.layers.3.mlp.experts.4.bias"
    other_rank = part_state_keys(NamedPart(first=6), 7)  # the same part on another expert-parallel rank
    assert set(keys.values()).isdisjoint(v for v in other_rank.values() if ".experts." in v)


def test_split_parts_keep_their_global_block_names_and_others_get_a_part_prefix() -> None:
    parts, _ = split_model([nn.Linear(2, 2) for _ in range(4)], 2, embedding=nn.Embedding(5, 2))
    assert names_whole_model(parts[1])
    assert sorted(part_state_keys(parts[1], 1).values()) == ["layer2.bias", "layer2.weight", "layer3.bias",
                                                             "layer3.weight"]
    plain = nn.Sequential(nn.Linear(2, 2))
    assert not names_whole_model(plain)
    assert part_state_keys(plain, 3) == {"0.weight": "part3.0.weight", "0.bias": "part3.0.bias"}
    expert_part = nn.Sequential(LocalExperts(2, 1))  # an inner hook still maps under the prefix
    assert part_state_keys(expert_part, 0)["0.experts.0.weight"] == "part0.0.experts.2.weight"


def test_colliding_names_are_an_error() -> None:
    class Collapse(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = nn.Linear(2, 2), nn.Linear(2, 2)

        def global_state_key(self, key: str) -> str:
            return "same." + key.split(".", 1)[1]

    with pytest.raises(ValueError, match="both map to 'same.weight'"):
        part_state_keys(Collapse(), 0)


def test_compiled_modules_are_named_as_the_modules_themselves() -> None:
    """torch.compile's wrapper (`_orig_mod.`) is left out: compiled and eager layouts share checkpoint names."""
    import torch

    parts, _ = split_model([nn.Linear(2, 2) for _ in range(4)], 2)
    eager = part_state_keys(parts[1], 1)
    layers = nn.Sequential()
    for name, child in parts[1].named_children():
        layers.add_module(name, torch.compile(child, backend="eager"))
    assert sorted(part_state_keys(layers, 1).values()) == sorted(eager.values())
    whole = torch.compile(parts[1], backend="eager")
    assert sorted(part_state_keys(whole, 1).values()) == sorted(eager.values())
    named = torch.compile(NamedPart(8), backend="eager")
    assert names_whole_model(named)
    assert set(part_state_keys(named, 0).values()) == set(part_state_keys(NamedPart(8), 0).values())
