"""benchmarks.data_memory: the files it generates, one small measurement in this process, its report (no figure
asserted: the memory is the machine's)."""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path

import pytest

pytest.importorskip("datasets")
pytest.importorskip("transformers")

from benchmarks import data_memory  # noqa: E402


def test_a_small_file_is_read_whole_and_reported(tmp_path: Path) -> None:
    cfg = data_memory.DataMemoryConfig(size_bytes=1 << 20, seq=64, words=50)
    data, model_dir = data_memory.write_files(tmp_path, cfg)
    assert data.stat().st_size == 1 << 20 and (model_dir / "config.json").is_file()
    result = data_memory._measure(str(data), str(model_dir), json.dumps(asdict(cfg)))
    text = data.read_text()
    stream = len(text.split()) + len([p for p in text.split("\n\n") if p.strip()])  # the words and an EOS each
    assert stream - cfg.seq < result["tokens"] <= stream + cfg.seq * cfg.batch_size  # one epoch, and a batch over
    assert result["tokens"] == result["steps"] * cfg.seq * cfg.batch_size
    assert result["base_rss"] > 0 and result["peak_rss"] > 0  # read from /proc (the peak is at least the base)
    (table,) = data_memory.report({**result, "file_bytes": 1 << 20})
    assert table[1][0] == "1 MiB" and table[1][3].startswith("**")


def test_a_file_under_a_mebibyte_is_refused() -> None:
    with pytest.raises(ValueError, match="size_bytes must be at least 1 MiB"):
        data_memory.DataMemoryConfig(size_bytes=1000)
