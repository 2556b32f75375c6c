"""Part: the memory of the `hf` task reading a large text file as a stream: peak resident memory above the model's."""

from __future__ import annotations

import json
import multiprocessing
import random
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path
from tempfile import TemporaryDirectory

from benchmarks import runner
from benchmarks.framework import Block, Part, Result


@dataclass(frozen=True)
class DataMemoryConfig:
    """A text file of `size_bytes` (paragraphs of random words, generated in a temporary folder) read by the hf
    task of a tiny Llama with a word-level tokenizer, one epoch walked in batches; the process's peak resident
    memory (VmHWM) against its resident memory once the model and tokenizer are loaded."""

    size_bytes: int = 1 << 30
    """Bytes of the text file."""
    seq: int = 1024
    """Tokens per window."""
    batch_size: int = 8
    """Windows per step."""
    words: int = 2000
    """Distinct words of the text (the tokenizer's vocabulary)."""

    def __post_init__(self) -> None:
        if self.size_bytes < 1 << 20:
            raise ValueError(f"size_bytes must be at least 1 MiB, got {self.size_bytes}")


QUICK = DataMemoryConfig(size_bytes=8 << 20, seq=256)


def _status(key: str) -> int:
    """A /proc/self/status figure in bytes (VmRSS, VmHWM)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
    raise ValueError(f"/proc/self/status has no {key}")


def write_files(folder: Path, cfg: DataMemoryConfig) -> tuple[Path, Path]:
    """The text file (a 4 MiB block of paragraphs written again and again, to `size_bytes`) and a tiny Llama with a
    word-level tokenizer over its words, in `folder`."""
    import transformers
    from tokenizers import Tokenizer, models, pre_tokenizers

    rng = random.Random(0)
    vocab = [f"w{i}" for i in range(cfg.words)]
    paragraphs = [" ".join(rng.choices(vocab, k=rng.randint(20, 300))) for _ in range(4096)]
    block = "\n\n".join(paragraphs).encode()[:4 << 20] + b"\n\n"
    data = folder / "text.txt"
    with data.open("wb") as f:
        for _ in range(cfg.size_bytes // len(block)):
            f.write(block)
        f.write(block[:cfg.size_bytes % len(block)])
    tok = Tokenizer(models.WordLevel({"<unk>": 0, "</s>": 1, **{w: i + 2 for i, w in enumerate(vocab)}},
                                     unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    model_dir = folder / "model"
    transformers.PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", eos_token="</s>").save_pretrained(
        model_dir)
    config = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, vocab_size=cfg.words + 2,
                                      max_position_embeddings=cfg.seq)
    transformers.LlamaForCausalLM(config).save_pretrained(model_dir)
    return data, model_dir


def _measure(data: str, model_dir: str, cfg_json: str) -> Result:
    """In a fresh process: load the model, note the resident memory, walk one epoch of the task's batches."""
    import transformers

    from duplexpipe.launch.tasks.hf import hf_task

    cfg = DataMemoryConfig(**json.loads(cfg_json))
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir)
    transformers.AutoTokenizer.from_pretrained(model_dir)
    base = _status("VmRSS")
    begin = time.perf_counter()
    task = hf_task(model=model_dir, data=data, seq=cfg.seq, val_fraction=0.0)
    tokens, step = 0, 0
    while task.batch.epoch == 0:  # type: ignore[attr-defined]
        tokens += int(task.batch(step, cfg.batch_size)[0].numel())
        step += 1
    seconds = time.perf_counter() - begin
    del model
    # the kernel's RSS counters lag by a few pages per thread, so VmHWM read now can fall under the VmRSS read before
    peak = max(_status("VmHWM"), base)
    return {"base_rss": base, "peak_rss": peak, "tokens": tokens, "steps": step, "seconds": seconds}


def run(cfg: DataMemoryConfig) -> Result:
    """Generate the files, then measure in a fresh (spawned) process."""
    with TemporaryDirectory() as tmp:
        data, model_dir = write_files(Path(tmp), cfg)
        spawn = multiprocessing.get_context("spawn")
        with ProcessPoolExecutor(max_workers=1, mp_context=spawn) as pool:
            result = pool.submit(_measure, str(data), str(model_dir), json.dumps(asdict(cfg))).result()
        return {**result, "file_bytes": data.stat().st_size}


def report(result: Result) -> list[Block]:
    """The file, the peak above the model's resident memory, the pace."""
    above = result["peak_rss"] - result["base_rss"]
    return [[["text file", "resident with the model", "peak while reading", "peak above the model's", "tokens",
              "MB/s"]] + [[f"{result['file_bytes'] / 2**20:,.0f} MiB", f"{result['base_rss'] / 2**20:,.0f} MiB",
                           f"{result['peak_rss'] / 2**20:,.0f} MiB", f"**{above / 2**20:,.0f} MiB**",
                           f"{result['tokens']:,}", f"{result['file_bytes'] / 1e6 / result['seconds']:.1f}"]]]


PART = Part("data_memory", "Memory of reading a large text file (hf task, streamed)", DataMemoryConfig(), QUICK, run,
            report, in_bench=False)

if __name__ == "__main__":
    raise SystemExit(runner.main(only=PART.name))
