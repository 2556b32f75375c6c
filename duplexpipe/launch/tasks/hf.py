"""The `hf` task of `duplexpipe train`: fine-tune a Hugging Face causal LM directory on text, JSON lines, Parquet or
Arrow data streamed through `datasets`, tokenized by the model's own tokenizer, documents ended by its end-of-sequence
token, a share of the windows held out for evaluation and the rest walked in epochs (`--task hf --task-option model=DIR
--task-option data=PATH`)."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import torch

from duplexpipe.launch.batch_streams import Batch, HeldOutBatches, StreamedBatches
from duplexpipe.launch.tasks.hf_data import data_files, documents
from duplexpipe.launch.tasks.hf_options import HFOptions, hf_options
from duplexpipe.launch.train_task import TrainTask
from duplexpipe.model.hf import IGNORE_INDEX, causal_lm_loss, causal_lm_targets
from duplexpipe.model.hf_files import stored_tensors
from duplexpipe.train.pretrained import check_model_dir

DTYPES = {"float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16, "float16": torch.float16}
"""The `dtype` option's values."""


def check_options(**options: Any) -> HFOptions:
    """The options `hf_task` takes, checked (before any process starts): ValueError naming what is wrong."""
    checked = hf_options(**{k: v for k, v in options.items() if k != "seed"})
    if checked.model is not None:
        check_model_dir(checked.model)
        stored_tensors(Path(checked.model))  # the index and every safetensors header, checked (no tensor is read)
    checked.check()
    assert checked.data is not None
    data_files(checked.data, checked.split)  # the files: regular, inside the folder given, one format
    if checked.model is not None:
        check_vocabulary(load_tokenizer(checked.tokenizer or checked.model, checked.model)[0], checked.model)
    return checked


def check_vocabulary(tokenizer: Any, model_dir: str) -> None:
    """ValueError naming both sizes when `tokenizer` can give ids the model in `model_dir` has no embedding row for
    (its vocabulary larger than the config's `vocab_size`)."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(model_dir)
    size = getattr(config.get_text_config(), "vocab_size", None)
    if isinstance(size, int) and len(tokenizer) > size:
        raise ValueError(f"task hf: the tokenizer's vocabulary holds {len(tokenizer):,} tokens, over the model's "
                         f"vocab_size {size:,} in {model_dir}/config.json: its ids would index past the embedding "
                         "(pass --task-option tokenizer=DIR with the model's own tokenizer)")


def load_tokenizer(tokenizer_dir: str, model_dir: str) -> tuple[Any, int | None]:
    """The tokenizer of `tokenizer_dir` (cutting nothing: the stream is cut into windows here) and its end-of-sequence
    token (else the model config's; None when neither has one)."""
    from transformers import AutoConfig, AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    except (OSError, ValueError) as exc:
        raise ValueError(f"task hf: no tokenizer in {tokenizer_dir} ({exc}); pass --task-option tokenizer=DIR") \
            from None
    tokenizer.model_max_length = 1 << 62
    eos = tokenizer.eos_token_id
    if eos is None:
        eos = getattr(AutoConfig.from_pretrained(model_dir), "eos_token_id", None)
        eos = eos[0] if isinstance(eos, list) and eos else eos
    return tokenizer, None if eos is None else int(eos)


def token_windows(docs: Iterable[str], tokenizer: Any, eos: int | None, seq: int, pack: bool,
                  chunk: int = 64) -> Iterator[Batch]:
    """The documents' tokens in windows of `seq`, each document followed by `eos`, one window a time as
    ((1, seq) ids, (1, seq) labels), tokenized `chunk` documents at a time. `pack`: the documents run on from
    window to window (the stream's last partial window is dropped) and the labels are the ids; otherwise each
    document starts a window and its last window is padded with `eos`, labelled -100 (not counted). ValueError when
    several documents have no end-of-sequence token to separate them."""
    buffer: list[int] = []
    count = 0
    for texts in _chunks(docs, chunk):
        for ids in tokenizer(texts, add_special_tokens=False)["input_ids"]:
            count += 1
            if eos is None and count > 1:
                raise ValueError("task hf: the tokenizer has no end-of-sequence token to separate the documents; "
                                 "give it an eos_token")
            buffer.extend(ids)
            if eos is not None:
                buffer.append(eos)
            if not pack:
                for lo in range(0, len(buffer), seq):
                    yield _padded(buffer[lo:lo + seq], seq, eos or 0)
                buffer = []
            while len(buffer) >= seq:
                window = torch.tensor(buffer[:seq], dtype=torch.long)[None]
                del buffer[:seq]
                yield window, window.clone()


def _padded(ids: list[int], seq: int, pad: int) -> Batch:
    """One window of `ids` padded to `seq` with `pad`, labelled -100 there."""
    window = torch.full((1, seq), pad, dtype=torch.long)
    window[0, :len(ids)] = torch.tensor(ids, dtype=torch.long)
    labels = window.clone()
    labels[0, len(ids):] = IGNORE_INDEX
    return window, labels


def _chunks(items: Iterable[str], size: int) -> Iterator[list[str]]:
    """`items` in lists of up to `size`."""
    chunk: list[str] = []
    for item in items:
        chunk.append(item)
        if len(chunk) == size:
            yield chunk
            chunk = []
    if chunk:
        yield chunk


def held_out(index: int, fraction: float) -> bool:
    """Whether window `index` (0, 1, ...) of the stream is held out: `fraction` of the windows, spread evenly (the
    indices where index x fraction passes a whole number)."""
    return math.floor((index + 1) * fraction) > math.floor(index * fraction)


def shuffled(rows: Iterable[Batch], size: int, generator: torch.Generator) -> Iterator[Batch]:
    """`rows` in an order drawn from `generator` through a buffer of `size` rows (a stream's shuffle: each row comes
    out at a random time once the buffer is full; 1: in order)."""
    buffer: list[Batch] = []
    for row in rows:
        if len(buffer) < size:
            buffer.append(row)
            continue
        pick = int(torch.randint(size, (1,), generator=generator))
        yield buffer[pick]
        buffer[pick] = row
    for pick in torch.randperm(len(buffer), generator=generator).tolist():
        yield buffer[pick]


class TokenStream:
    """The data's documents as token windows: the held-out windows (`held_out`) apart, the rest walked in epochs,
    each epoch shuffled through a buffer in an order drawn from (seed, epoch). Nothing is kept but the windows in
    the buffer and the documents being tokenized."""

    def __init__(self, opts: HFOptions, seed: int) -> None:
        assert opts.model is not None and opts.data is not None
        self.opts, self.seed = opts, seed
        self.files = data_files(opts.data, opts.split)
        self.tokenizer, self.eos = load_tokenizer(opts.tokenizer or opts.model, opts.model)

    def _windows(self, keep_held_out: bool) -> Iterator[Batch]:
        windows = token_windows(documents(self.files, self.opts.text_field), self.tokenizer, self.eos, self.opts.seq,
                                self.opts.pack)
        return (window for index, window in enumerate(windows)
                if held_out(index, self.opts.val_fraction) == keep_held_out)

    def epoch(self, epoch: int) -> Iterator[Batch]:
        """The training windows of `epoch`, shuffled."""
        generator = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
        return shuffled(self._windows(False), self.opts.shuffle_buffer, generator)

    def held_out(self) -> Iterator[Batch]:
        """The held-out windows, in order."""
        return self._windows(True)

    def first_window(self) -> Batch | None:
        """The first training window (None: the data holds none)."""
        return next(self._windows(False), None)


def hf_task(seed: int = 0, **options: Any) -> TrainTask:
    """Fine-tune the model in directory `model` on `data` in windows of `seq` tokens (see `HFOptions`).

    The data is read as a stream (`hf_data.documents`) and tokenized as it is read by the model's tokenizer (or the
    one in `tokenizer`), each document ended by its end-of-sequence token and the windows packed (or one document
    per window, padded, with `pack=False`). A `val_fraction` of the windows, spread evenly, is held out
    (`eval_batch`, in order); step s's batch is the s-th batch of a walk over the other windows in
    epochs, each epoch shuffled through a buffer in an order drawn from (seed, epoch): the same on every rank and
    every run, so a resumed run sees the batches it would have seen (it reads the stream up to its step again).
    Labels are the inputs (the loss shifts them). `dtype` overrides the checkpoint's; `bias_update_speed` is an
    MoE model's aux-loss-free balance (transformers' aux loss follows the model's config).
    """
    opts = check_options(**options)
    stream = TokenStream(opts, seed)
    if stream.first_window() is None:
        raise ValueError(f"task hf: the training documents of {opts.data} hold fewer tokens than a window of "
                         f"seq={opts.seq}")
    held = HeldOutBatches(stream.held_out) if opts.val_fraction > 0 else None
    batch: Callable[[int, int], Batch] = StreamedBatches(stream.epoch)
    eval_batch: Callable[[int, int], Batch] | None = held if held is not None and held.has_samples() else None
    if not opts.pack:  # padded windows: every counted token of a batch weighs the same in the pipelined loss
        batch, eval_batch = _token_weighted(batch), None if eval_batch is None else _token_weighted(eval_batch)
    return TrainTask(layers=[], loss_fn=causal_lm_loss, batch=batch, items_per_sample=opts.seq,
                     item_name="tokens", pretrained=opts.model,
                     dtype=DTYPES[opts.dtype] if opts.dtype is not None else None, eval_batch=eval_batch,
                     router_bias_update_speed=float(opts.bias_update_speed))


def _token_weighted(batches: Callable[[int, int], Batch]) -> Callable[[int, int], Batch]:
    """`batches` with the labels as `causal_lm_targets` (the batch's counted tokens with every row)."""
    def batch(index: int, batch_size: int) -> Batch:
        ids, labels = batches(index, batch_size)
        return ids, causal_lm_targets(labels)
    return batch
