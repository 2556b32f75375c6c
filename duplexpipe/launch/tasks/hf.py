"""The `hf` task of `duplexpipe train`: fine-tune a Hugging Face causal LM directory on a text or .jsonl file, tokenized
by the model's own tokenizer, documents joined with its end-of-sequence token, a held-out tail for evaluation and the
rest walked in epochs (`--task hf --task-option model=DIR --task-option data=FILE`)."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import torch

from duplexpipe.launch.tasks.hf_options import HFOptions, hf_options
from duplexpipe.launch.train_loop import TrainTask
from duplexpipe.model.hf import causal_lm_loss
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
    return checked


def documents(path: str) -> list[str]:
    """The documents of a data file: one per line of a .jsonl file (its "text" field), else the text's paragraphs
    (separated by blank lines). ValueError naming the file and line of a bad .jsonl record."""
    text = Path(path).read_text(encoding="utf-8")
    if not path.lower().endswith(".jsonl"):
        return [d.strip() for d in re.split(r"\n\s*\n", text) if d.strip()]
    docs = []
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ValueError(f"task hf: {path} line {number} is not JSON ({exc.msg})") from None
        if not isinstance(record, dict) or not isinstance(record.get("text"), str):
            raise ValueError(f"task hf: {path} line {number} has no \"text\" string field")
        docs.append(record["text"])
    return docs


def tokenize(docs: list[str], tokenizer_dir: str, model_dir: str) -> torch.Tensor:
    """The documents as one token stream, each followed by the end-of-sequence token (the tokenizer's, else the
    model config's); ValueError when several documents have none to separate them."""
    from transformers import AutoConfig, AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    except (OSError, ValueError) as exc:
        raise ValueError(f"task hf: no tokenizer in {tokenizer_dir} ({exc}); pass --task-option tokenizer=DIR") \
            from None
    tokenizer.model_max_length = 1 << 62  # the text is cut into windows here, not by the tokenizer
    eos = tokenizer.eos_token_id
    if eos is None:
        eos = getattr(AutoConfig.from_pretrained(model_dir), "eos_token_id", None)
        eos = eos[0] if isinstance(eos, list) and eos else eos
    if eos is None and len(docs) > 1:
        raise ValueError(f"task hf: the tokenizer in {tokenizer_dir} has no end-of-sequence token to separate the "
                         f"{len(docs)} documents; give it an eos_token")
    ids: list[int] = []
    for doc in tokenizer(docs, add_special_tokens=False)["input_ids"]:
        ids.extend(doc)
        if eos is not None:
            ids.append(int(eos))
    return torch.tensor(ids, dtype=torch.long)


def check_vocabulary(ids: torch.Tensor, tokenizer_dir: str, model_dir: str) -> None:
    """ValueError when the tokenizer gives token ids the model's embedding has no row for (a tokenizer of another
    model): named here, not as an index error inside a rank's forward."""
    from transformers import AutoConfig

    vocab = getattr(AutoConfig.from_pretrained(model_dir), "vocab_size", None)
    if isinstance(vocab, int) and len(ids) and int(ids.max()) >= vocab:
        raise ValueError(f"task hf: the tokenizer in {tokenizer_dir} gives token id {int(ids.max())}, but the model in "
                         f"{model_dir} has a vocabulary of {vocab} (ids 0..{vocab - 1}); use the model's tokenizer")


class Windows:
    """A token stream cut into windows of `seq` tokens: the last `val_fraction` held out for evaluation, the rest
    walked in epochs without replacement, each epoch in an order drawn from (seed, epoch); batches are pure functions
    of the step, so a resumed run continues where the saved one stopped."""

    def __init__(self, ids: torch.Tensor, seq: int, val_fraction: float, seed: int) -> None:
        held = int(len(ids) * val_fraction)
        cut = len(ids) - held
        self.seq, self.seed = seq, seed
        self.train = ids[:cut - cut % seq].view(-1, seq)
        self.held_out = ids[cut:cut + held - held % seq].view(-1, seq)
        self._orders: dict[int, torch.Tensor] = {}

    def order(self, epoch: int) -> torch.Tensor:
        """The train windows' order in `epoch` (the last two epochs' orders are kept)."""
        if epoch not in self._orders:
            gen = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
            self._orders = {e: o for e, o in self._orders.items() if e == epoch - 1}
            self._orders[epoch] = torch.randperm(len(self.train), generator=gen)
        return self._orders[epoch]

    def batch(self, step: int, batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Samples step x batch_size ... of the epochs' walk: (windows, the same windows as labels)."""
        count = len(self.train)
        rows = [self.order(i // count)[i % count] for i in range(step * batch_size, (step + 1) * batch_size)]
        windows = self.train[torch.stack(rows)]
        return windows, windows.clone()

    def eval_batch(self, index: int, batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Held-out batch `index`: the held-out windows in order, from index x batch_size on (wrapping around)."""
        rows = torch.arange(index * batch_size, (index + 1) * batch_size) % len(self.held_out)
        windows = self.held_out[rows]
        return windows, windows.clone()


def hf_task(seed: int = 0, **options: Any) -> TrainTask:
    """Fine-tune the model in directory `model` on `data` in windows of `seq` tokens (see `HFOptions`).

    The documents are tokenized once by the model's tokenizer (or the one in `tokenizer`) and joined with its
    end-of-sequence token; the stream's last `val_fraction` is held out (`eval_batch`), and step s's batch is the
    s-th batch of a walk over the remaining windows in epochs, each epoch in an order drawn from (seed, epoch): the
    same on every rank and every run, so a resumed run sees the batches it would have seen. Labels are the inputs
    (the loss shifts them). `dtype` overrides the checkpoint's; `bias_update_speed` is an MoE model's aux-loss-free
    balance (transformers' aux loss follows the model's config).
    """
    opts = check_options(**options)
    assert opts.model is not None and opts.data is not None
    docs = documents(opts.data)
    if not docs:
        raise ValueError(f"task hf: data file {opts.data} holds no text (expected documents separated by blank lines, "
                         "or .jsonl records with a \"text\" field)")
    ids = tokenize(docs, opts.tokenizer or opts.model, opts.model)
    check_vocabulary(ids, opts.tokenizer or opts.model, opts.model)
    windows = Windows(ids, opts.seq, opts.val_fraction, seed)
    if len(windows.train) == 0:
        raise ValueError(f"task hf: {opts.data} has {len(ids)} tokens, {int(len(ids) * (1 - opts.val_fraction))} "
                         f"for training: fewer than a window of seq={opts.seq}")
    return TrainTask(layers=[], loss_fn=causal_lm_loss, batch=windows.batch, items_per_sample=opts.seq,
                     item_name="tokens", pretrained=opts.model,
                     dtype=DTYPES[opts.dtype] if opts.dtype is not None else None,
                     eval_batch=windows.eval_batch if len(windows.held_out) else None,
                     router_bias_update_speed=float(opts.bias_update_speed))
