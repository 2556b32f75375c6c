"""Tests for duplexpipe.model.hf_fused: a published expert tensor found as a slice of a fused one, and read alone."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from duplexpipe.model.hf_files import read_into
from duplexpipe.model.hf_fused import FusedSlice, fused_source, renamed_source


@dataclass(frozen=True)
class _Stored:
    file: Path
    shape: tuple[int, ...]


def test_published_names_map_to_slices_of_the_fused_tensors(tmp_path: Path) -> None:
    gate_up = torch.arange(3 * 8 * 5, dtype=torch.float64).view(3, 8, 5)  # 3 experts, I = 4, D = 5
    down = -torch.arange(3 * 5 * 4, dtype=torch.float64).view(3, 5, 4)
    file = tmp_path / "model.safetensors"
    save_file({"model.layers.2.mlp.experts.gate_up_proj": gate_up, "model.layers.2.mlp.experts.down_proj": down,
               "model.layers.2.mlp.gate.weight": torch.zeros(3, 5, dtype=torch.float64)}, str(file))
    files = {"model.layers.2.mlp.experts.gate_up_proj": _Stored(file, (3, 8, 5)),
             "model.layers.2.mlp.experts.down_proj": _Stored(file, (3, 5, 4)),
             "model.layers.2.mlp.gate.weight": _Stored(file, (3, 5))}
    up = fused_source("model.layers.2.mlp.experts.1.up_proj.weight", files)
    w1 = fused_source("model.layers.2.block_sparse_moe.experts.2.w1.weight", files)  # Mixtral's published name
    w2 = fused_source("model.layers.2.block_sparse_moe.experts.0.w2.weight", files)
    assert up == FusedSlice(file, "model.layers.2.mlp.experts.gate_up_proj", 1, 4, 8, (4, 5))
    assert w1 is not None and (w1.expert, w1.start, w1.stop) == (2, 0, 4)
    assert w2 is not None and w2.name.endswith("down_proj") and w2.shape == (5, 4)
    assert fused_source("model.layers.2.mlp.experts.3.up_proj.weight", files) is None  # no expert 3
    assert fused_source("model.layers.2.mlp.gate.weight", files) is None
    assert renamed_source("model.layers.2.block_sparse_moe.gate.weight", files) == "model.layers.2.mlp.gate.weight"
    assert renamed_source("model.layers.2.mlp.gate.weight", files) is None
    targets = [torch.empty(4, 5, dtype=torch.float32), torch.empty(4, 5, dtype=torch.float64), torch.empty(5, 4)]
    read_into(zip([up, w1, w2], targets, strict=True))  # type: ignore[arg-type]
    assert torch.equal(targets[0], gate_up[1, 4:].float()) and torch.equal(targets[1], gate_up[2, :4])
    assert torch.equal(targets[2], down[0].float())
    with pytest.raises(ValueError, match=r"has shape \(4, 5\), the model needs \(5, 5\)"):
        read_into([(up, torch.empty(5, 5))])  # type: ignore[list-item]
