"""The safetensors files of a Hugging Face model directory, read tensor by tensor: a rank reads exactly the bytes of
the tensors it holds, straight into them (no mapping of whole files, no copy of the model)."""

from __future__ import annotations

import json
import struct
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

INDEX_FILE = "model.safetensors.index.json"
"""The index of a sharded checkpoint: {"weight_map": {tensor name: file name}}."""
SINGLE_FILE = "model.safetensors"
"""The one file of an unsharded checkpoint."""
DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16, "I64": torch.int64,
    "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8, "BOOL": torch.bool,
    "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
}
"""safetensors dtype names -> torch dtypes."""


@dataclass(frozen=True)
class StoredTensor:
    """Where one tensor's bytes are in a safetensors file."""

    file: Path
    """The file."""
    dtype: torch.dtype
    """Its dtype in the file."""
    shape: tuple[int, ...]
    """Its shape."""
    start: int
    """Byte offset of its data in the file."""
    stop: int
    """Byte offset just past its data."""


def read_header(file: Path) -> dict[str, StoredTensor]:
    """Every tensor of a safetensors file (the JSON header after its 8-byte length; the data follow it)."""
    with file.open("rb") as f:
        raw = f.read(8)
        if len(raw) != 8:
            raise ValueError(f"{file} is not a safetensors file (shorter than its header length)")
        (size,) = struct.unpack("<Q", raw)
        try:
            header = json.loads(f.read(size))
        except (json.JSONDecodeError, UnicodeDecodeError):
            raise ValueError(f"{file} is not a safetensors file (its header is not JSON)") from None
    base = 8 + size
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        if info["dtype"] not in DTYPES:
            raise ValueError(f"{file}: {name} has dtype {info['dtype']}, which is not supported")
        start, stop = info["data_offsets"]
        out[name] = StoredTensor(file, DTYPES[info["dtype"]], tuple(info["shape"]), base + start, base + stop)
    return out


def stored_tensors(root: Path) -> dict[str, StoredTensor]:
    """Every tensor of a model directory (through the index of a sharded checkpoint, else the one file)."""
    index = root / INDEX_FILE
    if index.is_file():
        weight_map = json.loads(index.read_text(encoding="utf-8")).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise ValueError(f"{index} has no weight_map")
        files = sorted({str(f) for f in weight_map.values()})
        absent = [f for f in files if not (root / f).is_file()]
        if absent:
            raise ValueError(f"{index} names files that are not there: {', '.join(absent[:3])}")
        headers = {f: read_header(root / f) for f in files}
        lost = [n for n, f in weight_map.items() if n not in headers[str(f)]]
        if lost:
            raise ValueError(f"{index} lists tensors its files lack: {', '.join(sorted(lost)[:3])}")
        return {n: headers[str(f)][n] for n, f in weight_map.items()}
    single = root / SINGLE_FILE
    if not single.is_file():
        raise ValueError(f"{root} holds no safetensors weights ({SINGLE_FILE} or {INDEX_FILE}); save the model with "
                         "transformers' save_pretrained (safetensors is its default)")
    return read_header(single)


def read_into(items: Iterable[tuple[StoredTensor, Tensor]]) -> None:
    """Copy each stored tensor into its target (same shape; any dtype and device): straight into a contiguous CPU
    target of the stored dtype, else through a buffer of that one tensor."""
    by_file: dict[Path, list[tuple[StoredTensor, Tensor]]] = {}
    for stored, target in items:
        if tuple(target.shape) != stored.shape:
            raise ValueError(f"{stored.file}: a tensor of shape {stored.shape} cannot fill one of "
                             f"{tuple(target.shape)}")
        by_file.setdefault(stored.file, []).append((stored, target))
    for file, pairs in by_file.items():
        with file.open("rb") as f, torch.no_grad():
            for stored, target in sorted(pairs, key=lambda p: p[0].start):
                direct = target.device.type == "cpu" and target.dtype == stored.dtype and target.is_contiguous()
                buffer = target if direct else torch.empty(stored.shape, dtype=stored.dtype)
                f.seek(stored.start)
                got = f.readinto(buffer.reshape(-1).view(torch.uint8).numpy().data) if buffer.numel() else 0
                if got != stored.stop - stored.start:
                    raise ValueError(f"{file} ends inside a tensor (read {got} of {stored.stop - stored.start} bytes)")
                if not direct:
                    target.copy_(buffer)
