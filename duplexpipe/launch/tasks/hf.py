"""The `hf` task of `duplexpipe train`: fine-tune a Hugging Face causal LM directory on a text file, tokenized by the
model's own tokenizer (`--task hf --task-option model=DIR --task-option data=FILE`)."""

from __future__ import annotations

from pathlib import Path

import torch

from duplexpipe.launch.train_loop import TrainTask
from duplexpipe.model.hf import causal_lm_loss
from duplexpipe.train.pretrained import check_model_dir

DTYPES = {"float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16, "float16": torch.float16}
"""The `dtype` option's values."""


def check_options(model: str | None = None, data: str | None = None, tokenizer: str | None = None, seq: int = 64,
                  dtype: str | None = None, bias_update_speed: float = 0.0, **_: object) -> None:
    """Raise ValueError for options `hf_task` cannot use (before any process starts)."""
    if model is None or data is None:
        raise ValueError("task hf needs --task-option model=DIR (a Hugging Face model directory) and "
                         "--task-option data=FILE (a text file)")
    check_model_dir(model)
    if not Path(data).is_file():
        raise ValueError(f"task hf: data file {data} does not exist")
    if tokenizer is not None and not Path(tokenizer).is_dir():
        raise ValueError(f"task hf: tokenizer directory {tokenizer} does not exist")
    if not isinstance(seq, int) or seq < 2:
        raise ValueError(f"task hf: seq must be an integer >= 2, got {seq!r}")
    if dtype is not None and dtype not in DTYPES:
        raise ValueError(f"task hf: dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    if isinstance(bias_update_speed, bool) or not isinstance(bias_update_speed, (int, float)) \
            or not bias_update_speed >= 0:
        raise ValueError(f"task hf: bias_update_speed must be a number >= 0, got {bias_update_speed!r}")


def tokenize(text: str, tokenizer_dir: str) -> torch.Tensor:
    """The text as token ids of the tokenizer saved in `tokenizer_dir` (no special tokens added)."""
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    except (OSError, ValueError) as exc:
        raise ValueError(f"task hf: no tokenizer in {tokenizer_dir} ({exc}); pass --task-option tokenizer=DIR") \
            from None
    tokenizer.model_max_length = 1 << 62  # the text is cut into windows here, not by the tokenizer
    return torch.tensor(tokenizer(text, add_special_tokens=False)["input_ids"], dtype=torch.long)


def hf_task(model: str | None = None, data: str | None = None, tokenizer: str | None = None, seq: int = 64,
            dtype: str | None = None, seed: int = 0, bias_update_speed: float = 0.0) -> TrainTask:
    """Fine-tune the model in directory `model` on `data` (UTF-8 text) in windows of `seq` tokens.

    The text is tokenized once by the model's tokenizer (or the one in `tokenizer`); step s's batch is windows at
    random offsets drawn from (seed, s), the same on every rank and every run, so a resumed run sees the batches
    it would have seen. Labels are the inputs (the loss shifts them). `dtype` (float32, float64, bfloat16,
    float16) overrides the checkpoint's. `bias_update_speed`: an MoE model's aux-loss-free balance (DeepSeek-V3's
    expert bias moves by this much after each optimizer step); transformers' aux loss follows the model's config.
    """
    check_options(model, data, tokenizer, seq, dtype, bias_update_speed)
    assert model is not None and data is not None
    ids = tokenize(Path(data).read_text(encoding="utf-8"), tokenizer or model)
    if len(ids) <= seq:
        raise ValueError(f"task hf: {data} has {len(ids)} tokens, fewer than a window of seq={seq} + 1")

    def batch(step: int, batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        gen = torch.Generator().manual_seed(seed * 1_000_003 + step)
        starts = torch.randint(0, len(ids) - seq, (batch_size,), generator=gen)
        windows = torch.stack([ids[s:s + seq] for s in starts.tolist()])
        return windows, windows.clone()

    return TrainTask(layers=[], loss_fn=causal_lm_loss, batch=batch, items_per_sample=seq, item_name="tokens",
                     pretrained=model, dtype=DTYPES[dtype] if dtype is not None else None,
                     router_bias_update_speed=float(bias_update_speed))
