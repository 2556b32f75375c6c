"""The `hf` task's data: text, JSON lines, Parquet and Arrow files, a folder saved by `datasets` and a folder of shards,
found safely and read through the `datasets` library as a stream of documents (nothing read is run as code)."""

from __future__ import annotations

import json
import os
import stat
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

FORMATS = {".parquet": "parquet", ".jsonl": "json", ".json": "json", ".arrow": "arrow", ".txt": "text",
           ".text": "text", ".md": "text"}
"""A data file's `datasets` builder by its suffix (a single file of another suffix is read as text)."""
MAX_FILES = 100_000
"""Most data files a folder may hold."""
MAX_METADATA_BYTES = 1 << 20
"""Largest `state.json` / `dataset_dict.json` of a saved `datasets` folder."""
MAX_DOCUMENT_CHARS = 1 << 26
"""Longest document (characters): a longer one is refused, not tokenized."""
MAX_JSON_BYTES = 1 << 26
"""Largest .json file (one JSON document may be read whole; JSON lines, .jsonl, have no limit)."""
READ_CHUNK_BYTES = 1 << 20
"""Bytes of a text or JSON lines file read at a time."""
PARQUET_BATCH_ROWS = 1024
"""Records of a Parquet file read at a time."""


@dataclass(frozen=True)
class DataFiles:
    """The files of a data path, all read by one `datasets` builder."""

    builder: str
    """"parquet", "json", "arrow" or "text"."""
    files: tuple[str, ...]
    """The files in reading order."""
    where: str
    """The path as given, for messages."""


def _regular(path: Path, root: Path, where: str) -> str:
    """`path` resolved, which must be a regular file inside `root`: ValueError naming it otherwise (a FIFO or a
    device would block or never end; a link out of the folder reads what the folder does not hold)."""
    real = os.path.realpath(path)
    if os.path.commonpath([real, os.path.realpath(root)]) != os.path.realpath(root):
        raise ValueError(f"task hf: {path} in data {where} leads outside it (to {real})")
    try:
        mode = os.stat(real).st_mode
    except OSError as exc:
        raise ValueError(f"task hf: data file {path} cannot be read ({exc.strerror})") from None
    if not stat.S_ISREG(mode):
        raise ValueError(f"task hf: data {path} is not a regular file (a FIFO, device or socket is refused)")
    return real


def _metadata(path: Path, where: str) -> Any:
    """A saved folder's JSON metadata file, size-checked and parsed (ValueError naming it)."""
    real = _regular(path, path.parent, where)
    if os.path.getsize(real) > MAX_METADATA_BYTES:
        raise ValueError(f"task hf: {path} is over {MAX_METADATA_BYTES:,} bytes: not a saved datasets folder")
    try:
        return json.loads(Path(real).read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"task hf: {path} is not JSON ({exc})") from None


def _saved(folder: Path, where: str, split: str) -> DataFiles:
    """The Arrow files of a folder `Dataset.save_to_disk` wrote (a `DatasetDict`'s: its `split`)."""
    if (folder / "dataset_dict.json").is_file():
        splits = _metadata(folder / "dataset_dict.json", where).get("splits", [])
        if split not in splits or "/" in split or split in (".", ".."):
            raise ValueError(f"task hf: data {where} holds the splits {splits}, not {split!r} (--task-option split=)")
        folder = folder / split
    state = _metadata(folder / "state.json", where)
    names: list[Any] = [entry.get("filename") for entry in state.get("_data_files", []) if isinstance(entry, dict)]
    if not names or not all(isinstance(n, str) and n and Path(n).name == n and n not in (".", "..") for n in names):
        raise ValueError(f"task hf: {folder / 'state.json'} names no plain data file names: {names}")
    return DataFiles("arrow", tuple(_regular(folder / n, folder, where) for n in names), where)


def data_files(path: str, split: str = "train") -> DataFiles:
    """The files behind `path`: one data file; a folder `datasets` saved (`state.json`, or `dataset_dict.json` and
    its `split`); or a folder of shards of one format (its files with a known suffix, in name order, subfolders
    included). ValueError naming the path when it is missing, empty, mixed, or holds a file that is not a regular
    file inside it."""
    root = Path(path)
    if not root.exists():
        raise ValueError(f"task hf: data {path} does not exist")
    if not root.is_dir():
        real = _regular(root, Path(os.path.realpath(root)).parent, path)
        return _sized(DataFiles(FORMATS.get(root.suffix.lower(), "text"), (real,), path))
    if (root / "state.json").is_file() or (root / "dataset_dict.json").is_file():
        return _saved(root, path, split)
    shards = sorted(p for p in root.rglob("*") if p.suffix.lower() in FORMATS and not p.is_dir())
    if len(shards) > MAX_FILES:
        raise ValueError(f"task hf: data folder {path} holds over {MAX_FILES:,} data files")
    builders = sorted({FORMATS[p.suffix.lower()] for p in shards})
    if not builders:
        raise ValueError(f"task hf: data folder {path} holds no data file (suffixes: {', '.join(FORMATS)})")
    if len(builders) > 1:
        raise ValueError(f"task hf: data folder {path} mixes formats ({', '.join(builders)}); keep one per folder")
    return _sized(DataFiles(builders[0], tuple(_regular(p, root, path) for p in shards), path))


def _sized(files: DataFiles) -> DataFiles:
    """`files`, with no empty file and no .json file over `MAX_JSON_BYTES` (ValueError naming it)."""
    for name in files.files:
        if os.path.getsize(name) == 0:
            raise ValueError(f"task hf: data file {name} is empty")
        if name.lower().endswith(".json") and os.path.getsize(name) > MAX_JSON_BYTES:
            raise ValueError(f"task hf: {name} is over {MAX_JSON_BYTES:,} bytes, and a .json file may be one JSON "
                             "document read whole; write it as JSON lines (.jsonl), which is streamed")
    return files


def documents(files: DataFiles, text_field: str = "text") -> Iterator[str]:
    """The documents of `files` in order, streamed by `datasets` (a batch of records at a time): a text file's
    paragraphs (separated by blank lines, stripped), a record's `text_field` otherwise. ValueError naming the data
    and the record when a record has no such string field or a document is over `MAX_DOCUMENT_CHARS`, and naming
    the data when it holds no document at all."""
    import datasets
    from datasets.exceptions import DatasetGenerationError

    by_builder: dict[str, dict[str, Any]] = {
        "text": {"sample_by": "paragraph", "chunksize": READ_CHUNK_BYTES}, "json": {"chunksize": READ_CHUNK_BYTES},
        "parquet": {"batch_size": PARQUET_BATCH_ROWS, "columns": [text_field]}}
    options = by_builder.get(files.builder, {})
    count = 0
    try:
        stream = datasets.load_dataset(files.builder, data_files=list(files.files), split="train", streaming=True,
                                       **options)
        field = "text" if files.builder == "text" else text_field
        for number, record in enumerate(stream, 1):
            text = record.get(field)
            if not isinstance(text, str):
                raise ValueError(f"task hf: record {number} of {files.where} has no {field!r} string field "
                                 f"(its fields: {', '.join(record)}; --task-option text_field=)")
            if len(text) > MAX_DOCUMENT_CHARS:
                raise ValueError(f"task hf: record {number} of {files.where} is over {MAX_DOCUMENT_CHARS:,} "
                                 "characters")
            if files.builder == "text":
                text = text.strip()
                if not text:
                    continue
            count += 1
            yield text
    except (DatasetGenerationError, OSError, UnicodeDecodeError) as exc:
        cause = exc.__cause__ or exc
        raise ValueError(f"task hf: data {files.where} cannot be read as {files.builder} "
                         f"({type(cause).__name__}: {str(cause)[:200]})") from None
    if count == 0:
        raise ValueError(f"task hf: data {files.where} holds no document: no text in it")
