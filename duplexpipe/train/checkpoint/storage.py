"""Checkpoint files read and written without running code: DCP's `.metadata` (a pickle) through an unpickler that
admits only the classes checkpoint metadata holds, file names from it kept inside the folder, and DCP's
FileSystemReader / FileSystemWriter with every file error tagged with the file it happened in."""

from __future__ import annotations

import contextlib
import io
import math
import os
import pickle
import pickletools
from collections.abc import Callable, Generator
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.filesystem import FileSystem, _StorageInfo
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorStorageMetadata,
)

from duplexpipe.errors import CheckpointError
from duplexpipe.files import open_new, plain_name, read_capped

METADATA_FILE = ".metadata"
"""The file DCP writes last into a checkpoint folder: what every tensor is and where its bytes are."""
MAX_METADATA_BYTES = 2**30
"""Largest `.metadata` file read (1 GiB); checkpoints of the largest models hold tens of MB."""
_DCP = "torch.distributed.checkpoint.metadata"
ALLOWED_CLASSES = frozenset({
    *((_DCP, name) for name in ("Metadata", "TensorStorageMetadata", "BytesStorageMetadata", "ChunkStorageMetadata",
                                "TensorProperties", "MetadataIndex", "StorageMeta", "_MEM_FORMAT_ENCODING")),
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),  # a layout by its name (torch.strided), as torch pickles one
    ("collections", "OrderedDict"),
    *(("pathlib", name) for name in ("Path", "PosixPath", "WindowsPath", "PurePath", "PurePosixPath",
                                     "PureWindowsPath")),  # StorageMeta.checkpoint_id
})
"""(module, name) of every class or function DCP metadata may name: found by saving a checkpoint of every layout the
project writes (plain, DualPipe, ZeRO-1, ZeRO-2, compressed with strategy state, experts, fp16 with a scaler and an
LR scheduler, bf16); torch dtypes (`torch.float32`, ...) are admitted besides."""
MAX_METADATA_NESTING = 64
"""Deepest nesting of containers a `.metadata` pickle may build (DCP's own nest about 8 deep): a deeper one (a tuple
nested a million deep overflows the C stack when hashed) is refused before it is unpickled."""
_IN_PLACE = frozenset({"APPEND", "APPENDS", "SETITEM", "SETITEMS", "ADDITEMS", "BUILD"})
"""Pickle opcodes that put what they pop into the object below it on the stack."""
_PUT = frozenset({"PUT", "BINPUT", "LONG_BINPUT"})
_GET = frozenset({"GET", "BINGET", "LONG_BINGET"})
FILE_ATTRIBUTE = "duplexpipe_checkpoint_file"
"""The attribute an error raised while reading or writing a checkpoint file carries: that file's path."""


class MetadataUnpickler(pickle.Unpickler):
    """Unpickles the metadata of checkpoint `where`: admits ALLOWED_CLASSES and torch dtypes, refuses every other
    global (no function of the file's choosing is ever called) and persistent ids with CheckpointError."""

    def __init__(self, data: bytes, where: str) -> None:
        super().__init__(io.BytesIO(data))
        self.where = where

    def _refuse(self, what: str) -> CheckpointError:
        return CheckpointError(f"checkpoint {self.where}: its {METADATA_FILE} names {what}, which checkpoint metadata "
                               "never holds; refused without loading it (a crafted file could run code)")

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in ALLOWED_CLASSES or (
                module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)):
            return super().find_class(module, name)
        raise self._refuse(f"{module}.{name}")

    def persistent_load(self, pid: Any) -> Any:
        raise self._refuse(f"a persistent object {str(pid)[:40]!r}")


def pickle_nesting(data: bytes, limit: int) -> int:
    """How deep the objects pickled in `data` nest, found by walking its opcodes without building anything; the walk
    stops once deeper than `limit` (the depth returned then exceeds it). ValueError, IndexError or KeyError for a
    stream that is not a pickle."""
    stack: list[list[int]] = []  # one cell per object on the unpickler's stack: its depth (shared with the memo)
    marks: list[int] = []
    memo: dict[int, list[int]] = {}
    deepest = 0
    for op, arg, _ in pickletools.genops(data):
        name = op.name
        if name == "MARK":
            marks.append(len(stack))
            continue
        if name in _PUT or name == "MEMOIZE":
            memo[len(memo) if name == "MEMOIZE" else int(arg or 0)] = stack[-1]
            continue
        if name in _GET:
            stack.append(memo[int(arg or 0)])
            continue
        if name == "DUP":
            stack.append(stack[-1])
            continue
        if pickletools.markobject in op.stack_before:
            start = marks.pop()
            popped, stack[start:] = stack[start:], []
        else:
            count = len(op.stack_before) - (1 if name in _IN_PLACE else 0)
            if count > len(stack):
                raise ValueError(f"{name} finds {len(stack)} objects on the stack")
            popped = stack[len(stack) - count:] if count else []
            del stack[len(stack) - count:]
        inner = 1 + max((cell[0] for cell in popped), default=-1) if popped else 0
        if name in _IN_PLACE:
            stack[-1][0] = max(stack[-1][0], inner)
        else:
            stack.extend([inner] for _ in op.stack_after)
        deepest = max(deepest, inner)
        if deepest > limit:
            break
    return deepest


def load_metadata_bytes(data: bytes, where: str) -> Metadata:
    """The Metadata pickled in `data` (from checkpoint `where`), checked; CheckpointError naming what is wrong. Its
    nesting is bounded (MAX_METADATA_NESTING) before anything is unpickled."""
    try:
        depth = pickle_nesting(data, MAX_METADATA_NESTING)
    except (ValueError, IndexError, KeyError) as exc:
        raise CheckpointError(f"checkpoint {where} is incomplete or corrupt ({METADATA_FILE}: {type(exc).__name__}: "
                              f"{exc})") from None
    if depth > MAX_METADATA_NESTING:
        raise CheckpointError(f"checkpoint {where}: its {METADATA_FILE} nests objects more than {MAX_METADATA_NESTING} "
                              "deep, which checkpoint metadata never does; refused without loading it (a crafted file "
                              "could crash the process)")
    try:
        metadata = MetadataUnpickler(data, where).load()
    except CheckpointError:
        raise
    except Exception as exc:  # noqa: BLE001 - truncated or garbled: any unpickling error
        raise CheckpointError(f"checkpoint {where} is incomplete or corrupt ({METADATA_FILE}: "
                              f"{type(exc).__name__}: {exc})") from None
    check_metadata(metadata, where)
    return metadata


def check_metadata(metadata: Any, where: str) -> None:
    """CheckpointError unless `metadata` is DCP Metadata whose entries are storage metadata and whose data files
    are plain file names in the folder at offsets >= 0."""
    def bad(what: str) -> CheckpointError:
        return CheckpointError(f"checkpoint {where} is incomplete or corrupt ({METADATA_FILE}: {what})")

    if not isinstance(metadata, Metadata) or not isinstance(metadata.state_dict_metadata, dict):
        raise bad(f"holds a {type(metadata).__name__}, not checkpoint metadata")
    kinds = (TensorStorageMetadata, BytesStorageMetadata)
    odd = next((k for k, v in metadata.state_dict_metadata.items() if not isinstance(k, str)
                or not isinstance(v, kinds)), None)
    if odd is not None:
        raise bad(f"entry {odd!r} is not tensor or bytes metadata")
    storage = metadata.storage_data if metadata.storage_data is not None else {}
    if not isinstance(storage, dict):
        raise bad("its storage table is not a table")
    for index, info in storage.items():
        if not isinstance(index, MetadataIndex) or not isinstance(info, _StorageInfo):
            raise bad(f"storage entry {index!r} is not a file location")
        plain_name(info.relative_path, f"checkpoint {where}: {METADATA_FILE}", CheckpointError)
        if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in (info.offset, info.length)):
            raise bad(f"{index.fqn} is at offset {info.offset!r}, length {info.length!r}")
    if metadata.storage_meta is not None and not isinstance(metadata.storage_meta, StorageMeta):
        raise bad("its storage meta is not StorageMeta")
    for key, entry in metadata.state_dict_metadata.items():
        if isinstance(entry, TensorStorageMetadata):
            _check_tensor(key, entry, storage, bad)


def _dims(values: Any) -> bool:
    return isinstance(values, tuple) and all(isinstance(v, int) and not isinstance(v, bool) and v >= 0
                                             for v in values)


def _check_tensor(key: str, entry: TensorStorageMetadata, storage: dict[Any, Any],
                  bad: Callable[[str], CheckpointError]) -> None:
    """`bad` unless tensor entry `key` has a size of whole numbers >= 0 whose chunks lie inside it, cover it, and
    each fit in the bytes stored for it: a crafted size is refused before anything of that size is allocated."""
    size, dtype = entry.size, getattr(entry.properties, "dtype", None)
    if not _dims(size) or not isinstance(dtype, torch.dtype):
        raise bad(f"{key} has size {size!r} and dtype {dtype!r}, not whole numbers >= 0 and a torch dtype")
    covered = 0
    for chunk in entry.chunks:
        offsets, sizes = chunk.offsets, chunk.sizes
        if not (_dims(offsets) and _dims(sizes) and len(offsets) == len(sizes) == len(size)
                and all(o + n <= d for o, n, d in zip(offsets, sizes, size, strict=True))):
            raise bad(f"{key} has a chunk at {offsets!r} of {sizes!r}, outside its size {tuple(size)}")
        info = storage.get(MetadataIndex(key, offsets))
        need = math.prod(sizes) * dtype.itemsize
        if info is None or need > info.length:
            stored = "no bytes" if info is None else f"{info.length:,} bytes in {info.relative_path}"
            raise bad(f"{key} has a chunk of {tuple(sizes)} {dtype} ({need:,} bytes) but {stored}")
        covered += math.prod(sizes)
    if covered < math.prod(size):
        raise bad(f"{key} has size {tuple(size)} ({math.prod(size):,} elements) but its chunks hold {covered:,}")


def read_metadata_file(folder: str | os.PathLike[str]) -> Metadata:
    """The checked Metadata of checkpoint `folder`; CheckpointError (a ValueError) when it is not a checkpoint, is
    incomplete or corrupt, or names a class or a file it must not."""
    path = Path(folder) / METADATA_FILE
    try:
        data = read_capped(path, MAX_METADATA_BYTES, "checkpoint metadata file", CheckpointError)
    except (FileNotFoundError, NotADirectoryError):
        raise CheckpointError(f"{folder} is not a checkpoint (no {METADATA_FILE} file)") from None
    except OSError as exc:
        raise CheckpointError(f"cannot read {path}: {exc.strerror}") from None
    return load_metadata_bytes(data, str(folder))


class NamingFileSystem(FileSystem):
    """DCP's local file system; an error raised while a file is open (or opened, or closed) carries its path in
    FILE_ATTRIBUTE, so the error a rank reports names the file."""

    @contextlib.contextmanager
    def create_stream(self, path: str | os.PathLike[str], mode: str) -> Generator[io.IOBase, None, None]:
        try:
            if "w" in mode:  # created anew, never through a link planted at its name
                with open_new(path, binary="b" in mode) as stream:
                    yield stream  # type: ignore[misc]
            else:
                with super().create_stream(path, mode) as stream:
                    yield stream
        except BaseException as exc:
            if getattr(exc, FILE_ATTRIBUTE, None) is None:
                with contextlib.suppress(AttributeError, TypeError):
                    setattr(exc, FILE_ATTRIBUTE, str(path))
            raise


class CheckpointReader(FileSystemReader):
    """DCP's FileSystemReader that reads `.metadata` with `MetadataUnpickler` (checked: data files are plain names
    in the folder) and tags file errors with the file. Tensors and values are read with torch.load(weights_only=True)
    as DCP does (values through `plain_state.WeightsOnlyLoadPlanner`)."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        super().__init__(path)
        self.fs = NamingFileSystem()

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        rank = kwargs.get("rank")
        if rank is not None:  # a rank-local metadata file (DCP without collectives): read the same way
            path = Path(self._get_metadata_path(rank))
            data = read_capped(path, MAX_METADATA_BYTES, "checkpoint metadata file", CheckpointError)
            metadata = load_metadata_bytes(data, str(self.path))
        else:
            metadata = read_metadata_file(self.path)
        if metadata.storage_meta is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


class CheckpointWriter(FileSystemWriter):
    """DCP's FileSystemWriter that tags file errors with the file and records the data files this rank wrote
    (`written`: names in the folder; the manifest's checksums are taken of them)."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        super().__init__(path)
        self.fs = _RecordingFileSystem()

    @property
    def written(self) -> list[str]:
        """The data files this rank wrote (names in the checkpoint folder; not the metadata)."""
        fs = self.fs
        assert isinstance(fs, _RecordingFileSystem)
        return sorted(fs.written)


class _RecordingFileSystem(NamingFileSystem):
    """NamingFileSystem that remembers the data files it opened for writing."""

    def __init__(self) -> None:
        super().__init__()
        self.written: set[str] = set()

    @contextlib.contextmanager
    def create_stream(self, path: str | os.PathLike[str], mode: str) -> Generator[io.IOBase, None, None]:
        name = Path(path).name
        if "w" in mode and not name.startswith(METADATA_FILE):
            self.written.add(name)
        with super().create_stream(path, mode) as stream:
            yield stream
