"""Tests for duplexpipe.launch.tasks.hf_data: every format the hf task reads gives the same documents in order, read
through `datasets` as a stream; a path that leads outside the folder, a FIFO, a crafted saved folder, mixed formats
and a huge .json are refused with their names."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

datasets = pytest.importorskip("datasets")
pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")

from duplexpipe.launch.tasks import hf_data  # noqa: E402
from duplexpipe.launch.tasks.hf_data import data_files, documents  # noqa: E402

DOCS = ["In the beginning", "b a\nc", "the end"]


def _all(path: Path, **kwargs: str) -> list[str]:
    return list(documents(data_files(str(path), **kwargs)))


def test_every_format_gives_the_documents_in_order(tmp_path: Path) -> None:
    (tmp_path / "docs.txt").write_text("\n\n".join(DOCS) + "\n\n\n", encoding="utf-8")
    (tmp_path / "docs.jsonl").write_text("".join(json.dumps({"text": d, "id": i}) + "\n" for i, d in enumerate(DOCS)))
    pq.write_table(pa.table({"id": [0, 1, 2], "body": DOCS}), tmp_path / "docs.parquet")
    saved = datasets.Dataset.from_dict({"text": DOCS})
    saved.save_to_disk(str(tmp_path / "saved"), num_shards=2)
    datasets.DatasetDict({"train": saved, "test": saved.select([0])}).save_to_disk(str(tmp_path / "dict"))
    shards = tmp_path / "shards"
    (shards / "b").mkdir(parents=True)
    pq.write_table(pa.table({"text": DOCS[:2]}), shards / "a.parquet")
    pq.write_table(pa.table({"text": DOCS[2:]}), shards / "b" / "c.parquet")
    saved_files = data_files(str(tmp_path / "saved"))
    assert saved_files.builder == "arrow" and len(saved_files.files) == 2
    for path in ("docs.txt", "docs.jsonl", "saved", "dict", "shards"):
        assert _all(tmp_path / path) == DOCS, path
    assert list(documents(data_files(str(tmp_path / "docs.parquet")), text_field="body")) == DOCS
    assert _all(tmp_path / "dict", split="test") == DOCS[:1]
    with pytest.raises(ValueError, match=r"holds the splits \['train', 'test'\], not 'valid'"):
        data_files(str(tmp_path / "dict"), split="valid")
    with pytest.raises(ValueError, match="record 1 of .*docs.jsonl has no 'body' string field"):
        list(documents(data_files(str(tmp_path / "docs.jsonl")), text_field="body"))


def test_paths_outside_the_folder_fifos_and_crafted_folders_are_refused(tmp_path: Path) -> None:
    outside = tmp_path / "secret.txt"
    outside.write_text("not yours")
    folder = tmp_path / "data"
    folder.mkdir()
    (folder / "a.txt").write_text("a")
    (folder / "link.txt").symlink_to(outside)
    with pytest.raises(ValueError, match="link.txt in data .* leads outside it"):
        data_files(str(folder))
    (folder / "link.txt").unlink()
    os.mkfifo(folder / "pipe.txt")
    with pytest.raises(ValueError, match="pipe.txt is not a regular file"):
        data_files(str(folder))
    with pytest.raises(ValueError, match="pipe.txt is not a regular file"):
        data_files(str(folder / "pipe.txt"))
    (folder / "pipe.txt").unlink()
    (folder / "b.parquet").write_bytes(b"")
    with pytest.raises(ValueError, match=r"mixes formats \(parquet, text\)"):
        data_files(str(folder))
    saved = tmp_path / "saved"
    saved.mkdir()
    (saved / "state.json").write_text(json.dumps({"_data_files": [{"filename": "../secret.txt"}]}))
    with pytest.raises(ValueError, match=r"names no plain data file names: \['\.\./secret\.txt'\]"):
        data_files(str(saved))
    (saved / "state.json").write_text(" " * (hf_data.MAX_METADATA_BYTES + 1))
    with pytest.raises(ValueError, match="state.json is over"):
        data_files(str(saved))
    with pytest.raises(ValueError, match="holds no data file"):
        data_files(str(_empty(tmp_path)))
    with pytest.raises(ValueError, match="data nowhere does not exist"):
        data_files("nowhere")


def _empty(tmp_path: Path) -> Path:
    (tmp_path / "empty").mkdir()
    return tmp_path / "empty"


def test_a_huge_json_document_and_a_huge_record_are_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(hf_data, "MAX_JSON_BYTES", 10)
    (tmp_path / "one.json").write_text(json.dumps([{"text": "a long document"}]))
    with pytest.raises(ValueError, match=r"one.json is over 10 bytes.*write it as JSON lines \(\.jsonl\)"):
        data_files(str(tmp_path / "one.json"))
    monkeypatch.setattr(hf_data, "MAX_DOCUMENT_CHARS", 5)
    (tmp_path / "long.txt").write_text("short\n\nmuch too long")
    with pytest.raises(ValueError, match="record 2 of .*long.txt is over 5 characters"):
        _all(tmp_path / "long.txt")


def test_empty_files_and_data_without_text_are_refused_naming_them(tmp_path: Path) -> None:
    (tmp_path / "shards").mkdir()
    (tmp_path / "shards" / "a.jsonl").write_text(json.dumps({"text": "a"}) + "\n")
    (tmp_path / "shards" / "b.jsonl").write_text("")
    with pytest.raises(ValueError, match=r"data file .*shards/b\.jsonl is empty"):
        data_files(str(tmp_path / "shards"))
    (tmp_path / "blank.jsonl").write_text("\n\n")
    with pytest.raises(ValueError, match=r"data .*blank\.jsonl holds no document: no text in it"):
        _all(tmp_path / "blank.jsonl")
