"""The safetensors files of a Hugging Face model directory, read tensor by tensor through the safetensors library (its
checks bound every header and offset): a rank reads only the tensors it holds; index entries must be plain file names
inside the directory."""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch
from safetensors import SafetensorError, safe_open
from torch import Tensor

from duplexpipe.files import plain_name, read_capped

INDEX_FILE = "model.safetensors.index.json"
"""The index of a sharded checkpoint: {"weight_map": {tensor name: file name}}."""
SINGLE_FILE = "model.safetensors"
"""The one file of an unsharded checkpoint."""
MAX_INDEX_BYTES = 64 * 2**20
"""Largest index file read (64 MiB; the indexes of the largest published models are a few MB)."""
DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16, "I64": torch.int64,
    "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8, "BOOL": torch.bool,
    "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2, "U16": torch.uint16, "U32": torch.uint32,
    "U64": torch.uint64,
}
"""safetensors dtype names -> torch dtypes."""


@dataclass(frozen=True)
class StoredTensor:
    """One tensor of a safetensors file: which file, its dtype and shape there, and its name in the file."""

    file: Path
    """The file."""
    dtype: torch.dtype
    """Its dtype in the file."""
    shape: tuple[int, ...]
    """Its shape."""
    name: str
    """Its name in the file."""

    def mismatch(self, shape: tuple[int, ...]) -> str:
        """Why it cannot fill a target of `shape`."""
        return f"{self.file}: a tensor of shape {self.shape} cannot fill one of {shape}"

    def read(self, handle: Any) -> Tensor:
        """The tensor, from `handle` (safetensors' `safe_open` of its file)."""
        return handle.get_tensor(self.name)


class Source(Protocol):
    """Where in a safetensors file a target tensor's values are: a `StoredTensor` or a fused slice of one."""

    @property
    def file(self) -> Path:
        """The file."""

    @property
    def shape(self) -> tuple[int, ...]:
        """The shape of what `read` returns."""

    def mismatch(self, shape: tuple[int, ...]) -> str:
        """Why it cannot fill a target of `shape`."""

    def read(self, handle: Any) -> Tensor:
        """Its values, from `handle` (safetensors' `safe_open` of its file)."""


def _bad_file(file: Path, exc: BaseException) -> ValueError:
    return ValueError(f"{file} is not a valid safetensors file ({exc})")


def read_header(file: Path) -> dict[str, StoredTensor]:
    """Every tensor of a safetensors file (its header, read and checked by the safetensors library); ValueError
    naming the file when it is not a valid one or holds a dtype torch cannot hold."""
    out = {}
    try:
        with safe_open(str(file), framework="pt", device="cpu") as f:
            for name in f.keys():
                piece = f.get_slice(name)
                kind = piece.get_dtype()
                if kind not in DTYPES:
                    raise ValueError(f"{file}: {name} has dtype {kind}, which is not supported")
                out[name] = StoredTensor(file, DTYPES[kind], tuple(int(n) for n in piece.get_shape()), name)
    except SafetensorError as exc:
        raise _bad_file(file, exc) from None
    except OSError as exc:
        raise ValueError(f"cannot read {file}: {exc.strerror or exc}") from None
    return out


def _weight_map(index: Path) -> dict[str, str]:
    """The index's tensor name -> file name table (plain names inside the directory, each checked)."""
    try:
        data = json.loads(read_capped(index, MAX_INDEX_BYTES, "safetensors index"))
    except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as exc:
        raise ValueError(f"{index} is not JSON ({exc})") from None
    weight_map = data.get("weight_map") if isinstance(data, dict) else None
    if not isinstance(weight_map, dict) or not weight_map:
        raise ValueError(f"{index} has no weight_map")
    return {str(name): plain_name(file, f"{index} (tensor {name})") for name, file in weight_map.items()}


def stored_tensors(root: Path) -> dict[str, StoredTensor]:
    """Every tensor of a model directory (through the index of a sharded checkpoint, else the one file)."""
    index = root / INDEX_FILE
    if index.is_file():
        weight_map = _weight_map(index)
        files = sorted(set(weight_map.values()))
        absent = [f for f in files if not (root / f).is_file()]
        if absent:
            raise ValueError(f"{index} names files that are not there: {', '.join(absent[:3])}")
        headers = {f: read_header(root / f) for f in files}
        lost = [n for n, f in weight_map.items() if n not in headers[f]]
        if lost:
            raise ValueError(f"{index} lists tensors its files lack: {', '.join(sorted(lost)[:3])}")
        return {n: headers[f][n] for n, f in weight_map.items()}
    single = root / SINGLE_FILE
    if not single.is_file():
        raise ValueError(f"{root} holds no safetensors weights ({SINGLE_FILE} or {INDEX_FILE}); save the model with "
                         "transformers' save_pretrained (safetensors is its default)")
    return read_header(single)


def read_into(items: Iterable[tuple[Source, Tensor]]) -> None:
    """Copy each source into its target (same shape; any dtype and device), file by file through the safetensors
    library (one tensor in memory at a time besides the targets)."""
    by_file: dict[Path, list[tuple[Source, Tensor]]] = {}
    for source, target in items:
        if tuple(target.shape) != source.shape:
            raise ValueError(source.mismatch(tuple(target.shape)))
        by_file.setdefault(source.file, []).append((source, target))
    for file, pairs in by_file.items():
        try:
            with safe_open(str(file), framework="pt", device="cpu") as f, torch.no_grad():
                for source, target in pairs:
                    target.copy_(source.read(f))
        except SafetensorError as exc:
            raise _bad_file(file, exc) from None
        except OSError as exc:
            raise ValueError(f"cannot read {file}: {exc.strerror or exc}") from None
