"""The `hf` task's options (`--task-option KEY=VALUE`), documented per field for `train --help`; torch-free."""

from __future__ import annotations

import textwrap
from dataclasses import dataclass, fields
from pathlib import Path

from duplexpipe.fielddoc import documented, field_docs

DTYPE_NAMES = ("float32", "float64", "bfloat16", "float16")
"""The `dtype` option's values."""


@documented
@dataclass(frozen=True)
class HFOptions:
    """What `--task hf` fine-tunes on, and how."""

    model: str | None = None
    """A Hugging Face causal LM directory (config.json and safetensors weights; its tokenizer unless `tokenizer`)."""
    data: str | None = None
    """The documents: a UTF-8 text file (documents separated by blank lines), a .jsonl, .parquet or .arrow file (one
    document per record, in its `text_field`), a folder `datasets` saved (`save_to_disk`), or a folder of such files
    of one format. Read as a stream; each document is ended by the tokenizer's end-of-sequence token."""
    tokenizer: str | None = None
    """A tokenizer directory (default: the model directory)."""
    seq: int = 64
    """Tokens per sample: the token stream is cut into windows of this many tokens."""
    dtype: str | None = None
    """float32, float64, bfloat16 or float16 (default: the checkpoint's)."""
    bias_update_speed: float = 0.0
    """An MoE model whose routers have an expert bias (DeepSeek-V3): how far each bias moves after an optimizer step
    (the aux-loss-free balance; transformers' aux loss follows the model's config)."""
    val_fraction: float = 0.1
    """The share of the token windows held out for evaluation (--eval-every), spread evenly through the stream (every
    tenth window for 0.1); the rest is walked in epochs, each window once per epoch in an order drawn from the
    seed."""
    text_field: str = "text"
    """The field of a record that holds its document (JSON lines, Parquet, Arrow)."""
    split: str = "train"
    """The split to read from a `DatasetDict` folder."""
    pack: bool = True
    """Pack the documents into the windows one after another; false: each document starts a window, and its last
    window is padded (the padding is not counted in the loss)."""
    shuffle_buffer: int = 1024
    """Windows in the buffer through which each epoch is shuffled (1: in order)."""

    def check(self) -> None:
        """ValueError for options the task cannot use (files, not their contents)."""
        if self.model is None or self.data is None:
            raise ValueError("task hf needs --task-option model=DIR (a Hugging Face model directory) and "
                             "--task-option data=PATH (a text, .jsonl, .parquet or .arrow file or a folder of them)")
        if not Path(self.data).exists():
            raise ValueError(f"task hf: data {self.data} does not exist")
        if self.tokenizer is not None and not Path(self.tokenizer).is_dir():
            raise ValueError(f"task hf: tokenizer directory {self.tokenizer} does not exist")
        if isinstance(self.seq, bool) or not isinstance(self.seq, int) or self.seq < 2:
            raise ValueError(f"task hf: seq must be an integer >= 2, got {self.seq!r}")
        for name in ("text_field", "split"):
            if not isinstance(getattr(self, name), str) or not getattr(self, name):
                raise ValueError(f"task hf: {name} must be a name, got {getattr(self, name)!r}")
        if not isinstance(self.pack, bool):
            raise ValueError(f"task hf: pack must be true or false, got {self.pack!r}")
        if isinstance(self.shuffle_buffer, bool) or not isinstance(self.shuffle_buffer, int) or self.shuffle_buffer < 1:
            raise ValueError(f"task hf: shuffle_buffer must be an integer >= 1, got {self.shuffle_buffer!r}")
        if self.dtype is not None and self.dtype not in DTYPE_NAMES:
            raise ValueError(f"task hf: dtype must be one of {', '.join(DTYPE_NAMES)}, got {self.dtype!r}")
        if isinstance(self.bias_update_speed, bool) or not isinstance(self.bias_update_speed, (int, float)) \
                or not self.bias_update_speed >= 0:
            raise ValueError(f"task hf: bias_update_speed must be a number >= 0, got {self.bias_update_speed!r}")
        if isinstance(self.val_fraction, bool) or not isinstance(self.val_fraction, (int, float)) \
                or not 0 <= self.val_fraction < 1:
            raise ValueError(f"task hf: val_fraction must be a number in [0, 1), got {self.val_fraction!r}")


def hf_options(**options: object) -> HFOptions:
    """HFOptions from task options; ValueError naming options it does not take."""
    known = [f.name for f in fields(HFOptions)]
    unknown = sorted(set(options) - set(known))
    if unknown:
        raise ValueError(f"task hf: unknown option(s) {unknown}; it takes {', '.join(known)}")
    return HFOptions(**options)  # type: ignore[arg-type]


def options_help(width: int = 100) -> str:
    """The options as help lines: `  name (default X): what it is`, wrapped (the fields' docstrings)."""
    docs = field_docs(HFOptions)
    lines = []
    for f in fields(HFOptions):
        lines.extend(textwrap.wrap(f"{f.name} (default {f.default}): {docs.get(f.name, '')}", width,
                                   initial_indent="  ", subsequent_indent="      "))
    return "\n".join(lines)
