"""Tests for duplexpipe.model.hf_files: safetensors files read tensor by tensor into their targets."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from duplexpipe.model.hf_files import INDEX_FILE, read_header, read_into, stored_tensors


def test_tensors_are_read_into_targets_of_any_dtype(tmp_path: Path) -> None:
    tensors = {"a": torch.randn(3, 4, dtype=torch.float64), "b": torch.randn(5).bfloat16(),
               "c": torch.arange(6, dtype=torch.int64).view(2, 3), "empty": torch.zeros(0, 2)}
    save_file(tensors, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    stored = stored_tensors(tmp_path)
    assert stored["b"].dtype == torch.bfloat16 and stored["a"].shape == (3, 4)
    same = {k: torch.empty_like(v) for k, v in tensors.items()}
    wider = torch.empty(5, dtype=torch.float32)
    strided = torch.empty(4, 3, dtype=torch.float64).t()  # not contiguous: through a buffer
    read_into([(stored[k], t) for k, t in same.items()] + [(stored["b"], wider), (stored["a"], strided)])
    for key, value in tensors.items():
        assert torch.equal(same[key], value), key
    assert torch.equal(wider, tensors["b"].float()) and torch.equal(strided, tensors["a"])
    with pytest.raises(ValueError, match=r"a tensor of shape \(3, 4\) cannot fill one of \(4, 3\)"):
        read_into([(stored["a"], torch.empty(4, 3, dtype=torch.float64))])


def test_sharded_directories_follow_their_index(tmp_path: Path) -> None:
    save_file({"x": torch.ones(2)}, str(tmp_path / "part-1.safetensors"))
    save_file({"y": torch.zeros(3)}, str(tmp_path / "part-2.safetensors"))
    save_file({"x": torch.full((2,), 7.0)}, str(tmp_path / "stale.safetensors"))  # not in the index: ignored
    index = {"weight_map": {"x": "part-1.safetensors", "y": "part-2.safetensors"}}
    (tmp_path / INDEX_FILE).write_text(json.dumps(index))
    stored = stored_tensors(tmp_path)
    target = torch.empty(2)
    read_into([(stored["x"], target)])
    assert torch.equal(target, torch.ones(2)) and stored["y"].file.name == "part-2.safetensors"
    (tmp_path / INDEX_FILE).write_text(json.dumps({"weight_map": {"x": "gone.safetensors"}}))
    with pytest.raises(ValueError, match="names files that are not there: gone.safetensors"):
        stored_tensors(tmp_path)
    (tmp_path / "bad.safetensors").write_bytes(b"\x02\x00\x00\x00\x00\x00\x00\x00{x")
    with pytest.raises(ValueError, match="its header is not JSON"):
        read_header(tmp_path / "bad.safetensors")
