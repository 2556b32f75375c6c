"""Tests for duplexpipe.model.hf_files: safetensors files read tensor by tensor into their targets through the
safetensors library; a malformed file (huge header, missing dtype, negative offset, cut short) and an index naming a
file outside the directory are refused with one clear error."""

from __future__ import annotations

import json
import re
import struct
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from duplexpipe.model.hf_files import INDEX_FILE, MAX_INDEX_BYTES, read_header, read_into, stored_tensors


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
    with pytest.raises(ValueError, match="bad.safetensors is not a valid safetensors file"):
        read_header(tmp_path / "bad.safetensors")


def _raw(header: bytes, data: bytes = b"\0" * 4) -> bytes:
    return struct.pack("<Q", len(header)) + header + data


@pytest.mark.parametrize(("content", "why"), [
    (struct.pack("<Q", 2**60) + b"{}", "header too large"),
    (_raw(json.dumps({"a": {"shape": [1], "data_offsets": [0, 4]}}).encode()), "missing field `dtype`"),
    (_raw(json.dumps({"a": {"dtype": "F32", "shape": [1], "data_offsets": [-4, 0]}}).encode()), "`-4`"),
    (_raw(json.dumps({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}).encode()), "incomplete"),
    (b"\x01\x02", "header too small"),
])
def test_malformed_files_are_one_clear_error(tmp_path: Path, content: bytes, why: str) -> None:
    (tmp_path / "model.safetensors").write_bytes(content)
    with pytest.raises(ValueError, match=rf"model.safetensors is not a valid safetensors file \(.*{re.escape(why)}"):
        stored_tensors(tmp_path)


@pytest.mark.parametrize("name", ["../outside.safetensors", "/etc/passwd", "sub/part.safetensors"])
def test_an_index_must_name_plain_files_in_the_directory(tmp_path: Path, name: str) -> None:
    outside = tmp_path / "model"
    outside.mkdir()
    save_file({"x": torch.ones(2)}, str(tmp_path / "outside.safetensors"))
    (outside / INDEX_FILE).write_text(json.dumps({"weight_map": {"x": name}}))
    with pytest.raises(ValueError, match=rf"tensor x\) names '{re.escape(name)}', which is not a plain file name"):
        stored_tensors(outside)


def test_a_huge_index_is_refused_before_it_is_read(tmp_path: Path) -> None:
    with open(tmp_path / INDEX_FILE, "wb") as fh:
        fh.truncate(MAX_INDEX_BYTES + 1)
    with pytest.raises(ValueError, match="over the 64 MiB limit for a safetensors index"):
        stored_tensors(tmp_path)
