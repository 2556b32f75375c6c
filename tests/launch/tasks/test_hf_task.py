"""Tests for duplexpipe.launch.tasks.hf: `duplexpipe train --task hf` fine-tunes a transformers directory on a text or
.jsonl file with its own tokenizer (documents joined by its EOS, a held-out tail, epochs without replacement), and
`--save-pretrained` hands transformers the result: the README's two commands, with 1F1B and DualPipeV."""

from __future__ import annotations

import pytest

pytest.importorskip("transformers")

import argparse  # noqa: E402
import io  # noqa: E402
import json  # noqa: E402
import re  # noqa: E402
import shlex  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

import torch  # noqa: E402
from _hf_helpers import eos_tokenizer, rel, tiny_llama, transformers  # noqa: E402

from duplexpipe.cli.train_cmd import add_train_arguments, train_main  # noqa: E402
from duplexpipe.launch.tasks.gpt import corpus_text  # noqa: E402
from duplexpipe.launch.tasks.hf import check_options, hf_task, load_tokenizer, token_windows  # noqa: E402
from duplexpipe.launch.tasks.hf_options import options_help  # noqa: E402

ROOT = Path(__file__).resolve().parents[3]
TEXT = corpus_text()[:4000]
EOS = "</s>"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("hf-task")
    transformers.logging.set_verbosity_error()
    tiny_llama(layers=4).save_pretrained(root / "tiny")
    eos_tokenizer(TEXT).save_pretrained(root / "tiny")
    (root / "data.txt").write_text(TEXT, encoding="utf-8")
    (root / "notes.txt").write_text(TEXT, encoding="utf-8")
    return root


def _task(model_dir: Path, **options: Any) -> Any:
    return hf_task(**{"model": str(model_dir / "tiny"), "data": str(model_dir / "data.txt"), **options})


def test_documents_are_ended_by_the_tokenizers_eos_packed_or_one_a_window(model_dir: Path) -> None:
    tokenizer, eos = load_tokenizer(str(model_dir / "tiny"), str(model_dir / "tiny"))
    names = tokenizer.convert_ids_to_tokens
    packed = list(token_windows(iter(["ab", "b a"]), tokenizer, eos, seq=3, pack=True))
    assert [names(x[0].tolist()) for x, _ in packed] == [["a", "b", EOS], ["b", " ", "a"]]  # the last EOS: a part
    assert all(torch.equal(x, y) for x, y in packed)
    alone = list(token_windows(iter(["ab", "b a"]), tokenizer, eos, seq=4, pack=False))
    assert [names(x[0].tolist()) for x, _ in alone] == [["a", "b", EOS, EOS], ["b", " ", "a", EOS]]
    assert alone[0][1].tolist() == [[*alone[0][0][0, :3].tolist(), -100]] and torch.equal(*alone[1])
    with pytest.raises(ValueError, match="no end-of-sequence token to separate the documents"):
        list(token_windows(iter(["ab", "b a"]), tokenizer, None, seq=3, pack=True))


def _one_window_each(model_dir: Path, count: int) -> Path:
    """A JSON lines file of `count` documents of 3 characters: with EOS, one window of 4 tokens each."""
    letters = sorted(set("abcdefgh"))
    docs = [letters[i // 64 % 8] + letters[i // 8 % 8] + letters[i % 8] for i in range(count)]
    path = model_dir / f"windows{count}.jsonl"
    path.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs), encoding="utf-8")
    return path


def test_epochs_walk_every_window_once_per_seed_and_hold_out_every_fifth(model_dir: Path) -> None:
    data = str(_one_window_each(model_dir, 50))
    task = _task(model_dir, data=data, seq=4, val_fraction=0.2, seed=3)
    stream = [x for x, _ in token_windows((json.loads(line)["text"] for line in Path(data).read_text().splitlines()),
                                          *load_tokenizer(str(model_dir / "tiny"), str(model_dir / "tiny")), 4, True)]
    held = torch.cat(stream[4::5])  # windows 4, 9, 14, ...: a fifth, spread evenly
    train = sorted(tuple(w[0].tolist()) for i, w in enumerate(stream) if i % 5 != 4)
    first_epoch = torch.cat([task.batch(s, 5)[0] for s in range(8)])  # 40 windows: one epoch
    assert sorted(tuple(w) for w in first_epoch.tolist()) == train  # each train window once
    second = torch.cat([task.batch(s, 5)[0] for s in range(8, 16)])
    assert sorted(tuple(w) for w in second.tolist()) == train and not torch.equal(first_epoch, second)
    again = _task(model_dir, data=data, seq=4, val_fraction=0.2, seed=3)
    assert torch.equal(again.batch(11, 5)[0], task.batch(11, 5)[0])  # a resumed run: the same batch at step 11
    assert torch.equal(task.batch(3, 5)[0], first_epoch[15:20])  # an earlier step: read again from the start
    assert not torch.equal(_task(model_dir, data=data, seq=4, val_fraction=0.2, seed=4).batch(0, 5)[0],
                           first_epoch[:5])
    assert task.eval_batch is not None
    assert torch.equal(task.eval_batch(3, 3)[0], held[[9, 0, 1]])  # in order, wrapping around
    assert _task(model_dir, data=data, seq=4, val_fraction=0.0).eval_batch is None


def test_the_reader_holds_a_bounded_window_not_the_file(model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A text walked for a whole epoch, one character a token: at every step the reader has read at most a few
    tokenizer chunks of documents (64 of 400 characters) and the shuffle buffer's windows beyond what the batches
    took, however long the file."""
    from duplexpipe.launch.tasks import hf

    text = "\n\n".join(TEXT[i:i + 399].strip() for i in range(0, len(TEXT), 399))
    path = model_dir / "big.txt"
    path.write_text("\n\n".join([text] * 200), encoding="utf-8")
    read = [0]

    def counted(*args: Any, **kwargs: Any) -> Any:
        for doc in documents(*args, **kwargs):
            read[0] += len(doc) + 1  # and its EOS
            yield doc

    documents = hf.documents
    monkeypatch.setattr(hf, "documents", counted)
    task = _task(model_dir, data=str(path), seq=64, shuffle_buffer=32, val_fraction=0.0)
    read[0] = 0
    ahead, step = [], 0
    while read[0] < path.stat().st_size * 0.95:
        task.batch(step, 8)
        ahead.append(read[0] - (step + 1) * 8 * 64)
        step += 1
    bound = 2 * 64 * 400 + 32 * 64 + 64
    assert step > 1000 and 0 < max(ahead) < bound < path.stat().st_size / 4, (max(ahead), bound, step)


def test_bad_options_are_named_and_documented_in_help(model_dir: Path) -> None:
    tiny, data = str(model_dir / "tiny"), str(model_dir / "data.txt")
    with pytest.raises(ValueError, match="data nowhere.txt does not exist"):
        check_options(model=tiny, data="nowhere.txt")
    with pytest.raises(ValueError, match="seq must be an integer >= 2"):
        check_options(model=tiny, data=data, seq=1)
    with pytest.raises(ValueError, match="dtype must be one of float32"):
        check_options(model=tiny, data=data, dtype="int4")
    with pytest.raises(ValueError, match=r"unknown option\(s\) \['sequence'\]; it takes model, data, tokenizer"):
        check_options(model=tiny, data=data, sequence=8)
    bad = model_dir / "bad"  # a crafted model folder: its index points outside, then its header is huge
    bad.mkdir()
    (bad / "config.json").write_bytes((model_dir / "tiny" / "config.json").read_bytes())
    (bad / "model.safetensors.index.json").write_text('{"weight_map": {"x": "../tiny/model.safetensors"}}')
    with pytest.raises(ValueError, match=r"names '\.\./tiny/model\.safetensors', which is not a plain file name"):
        check_options(model=str(bad), data=data)
    (bad / "model.safetensors.index.json").unlink()
    (bad / "model.safetensors").write_bytes((2**60).to_bytes(8, "little") + b"{}")
    with pytest.raises(ValueError, match=r"model.safetensors is not a valid safetensors file \(.*header too large"):
        check_options(model=str(bad), data=data)
    with pytest.raises(ValueError, match="fewer tokens than a window of seq=10000"):
        _task(model_dir, seq=10_000)
    text = options_help()
    for name in ("seq (default 64)", "tokenizer (default None)", "dtype (default None)", "val_fraction"):
        assert name in text


def _readme_command(schedule: str, model: Path, extra: str = "") -> list[str]:
    """The documented Hugging Face fine-tuning command (once in the README, now in the Hugging Face guide) as
    written, with a local model directory, `schedule`, two steps instead of 100 and `extra` flags added."""
    text = (ROOT / "docs" / "huggingface.md").read_text(encoding="utf-8")
    command = re.search(r"^duplexpipe train --task hf --task-option model=\./.*?(?<!\\)$", text, re.M | re.S)
    assert command is not None, "the guide's hf command"
    words = shlex.split(command.group(0).replace("\\\n", " "))
    words[words.index("--schedule") + 1] = schedule
    words[words.index("--steps") + 1] = "2"
    model_option = next(w for w in words if w.startswith("model="))
    words[words.index(model_option)] = f"model={model}"
    return words[2:] + shlex.split(extra)


def _run(words: list[str]) -> str:
    parser = argparse.ArgumentParser()
    add_train_arguments(parser)
    out = io.StringIO()
    assert train_main(parser.parse_args(words), out) == 0
    return out.getvalue()


def _generates(path: Path) -> None:
    """The README's second command, in plain transformers: load the export and generate."""
    tuned = transformers.AutoModelForCausalLM.from_pretrained(path)
    tokenizer = transformers.AutoTokenizer.from_pretrained(path)
    ids = tokenizer("In the", return_tensors="pt")["input_ids"]
    assert tuned.generate(ids, max_new_tokens=4, min_new_tokens=4, do_sample=False).shape == (1, ids.shape[1] + 4)


@pytest.mark.timeout(300)
def test_readme_command_with_dualpipev_trains_and_transformers_generates(model_dir: Path,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """The pre-start check counted the task's `layers` (empty for hf): every named schedule was refused."""
    monkeypatch.chdir(model_dir)
    out = _run(_readme_command("dualpipev", model_dir / "tiny"))
    assert "dualpipev on pp 2 x dp 1 x tp 1 x ep 1 (ZeRO 0, sequence parallel off), 2 steps" in out
    assert "tokens/s" in out and "items/s" not in out
    assert re.search(r"^ +3 +3\.\.3 \+head", out, re.M), out  # the partition: 4 parts of one layer
    tuned, info = transformers.AutoModelForCausalLM.from_pretrained(model_dir / "tuned", output_loading_info=True)
    assert not any(info.values()), info
    source = transformers.AutoModelForCausalLM.from_pretrained(model_dir / "tiny")
    moved = [rel(tuned.state_dict()[k], v) for k, v in source.state_dict().items()]
    assert min(moved) > 0 and max(moved) < 0.5, moved  # every tensor trained, none blown up
    _generates(model_dir / "tuned")


@pytest.mark.timeout(300)
def test_readme_command_with_1f1b_and_eval_matches_the_model_on_the_held_out_data(
        model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """--eval-every reports the exported model's loss on the held-out windows, computed in one process (fp64)."""
    monkeypatch.chdir(model_dir)
    out = _run(_readme_command("1f1b", model_dir / "tiny", "--task-option dtype=float64 --eval-every 2 "
                               "--eval-batches 2 --out-dir run --no-tensorboard"))
    reported = float(re.search(r"eval loss (\d+\.\d+)", out).group(1))  # type: ignore[union-attr]
    rows = [json.loads(line) for line in (model_dir / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "eval_loss" in r] == [2]
    assert "0..1 +emb" in (model_dir / "run" / "partition.txt").read_text()  # was empty for the hf task
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir / "tuned", dtype=torch.float64)
    task = hf_task(model=str(model_dir / "tiny"), data="notes.txt", dtype="float64")
    assert task.eval_batch is not None
    with torch.no_grad():  # transformers' own loss casts the logits to float32: the mean cross-entropy in fp64
        logits = [(model(x).logits, y) for x, y in (task.eval_batch(i, 32) for i in range(2))]
        losses = [float(torch.nn.functional.cross_entropy(z[:, :-1].flatten(0, 1), y[:, 1:].flatten()))
                  for z, y in logits]
    assert logits[0][0].dtype == torch.float64
    assert abs(rows[-1]["eval_loss"] - sum(losses) / 2) < 1e-12, (rows[-1], losses)
    assert abs(reported - sum(losses) / 2) < 1e-4
    _generates(model_dir / "tuned")


@pytest.mark.timeout(300)
def test_a_parquet_file_fine_tunes_from_the_command_line(model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The data people hold: verses as records of a Parquet file, streamed into two ranks under 1F1B with a held-out
    evaluation; the export loads in transformers with every tensor trained (a saved `datasets` folder: below)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    monkeypatch.chdir(model_dir)
    verses = [line for line in TEXT.splitlines() if line.strip()]
    pq.write_table(pa.table({"id": list(range(len(verses))), "verse": verses}), model_dir / "verses.parquet")
    source = transformers.AutoModelForCausalLM.from_pretrained(model_dir / "tiny")
    for data, tuned_dir in (("verses.parquet --task-option text_field=verse", "parquet-tuned"),):
        out = _run(shlex.split(f"--task hf --task-option model=tiny --task-option data={data} --task-option seq=16 "
                               "--schedule 1f1b --ranks 2 --microbatches 2 --batch-size 4 --steps 2 --log-every 0 "
                               f"--eval-every 2 --eval-batches 1 --no-tensorboard --save-pretrained {tuned_dir}"))
        summary = "1f1b on pp 2 x dp 1 x tp 1 x ep 1 (ZeRO 0, sequence parallel off), 2 steps"
        assert summary in out and re.search(r"eval loss \d+\.\d+", out), out
        tuned, info = transformers.AutoModelForCausalLM.from_pretrained(model_dir / tuned_dir,
                                                                        output_loading_info=True)
        assert not any(info.values()), info
        moved = [rel(tuned.state_dict()[k], v) for k, v in source.state_dict().items()]
        assert min(moved) > 0 and max(moved) < 0.5, (data, moved)


@pytest.mark.timeout(300)
def test_schedule_auto_merges_parts_and_the_export_names_them_as_the_model_does(
        model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """On a folder `datasets` saved, one verse a record and one record a padded window (pack=false)."""
    datasets = pytest.importorskip("datasets")
    monkeypatch.chdir(model_dir)
    datasets.Dataset.from_dict({"text": [line for line in TEXT.splitlines() if line.strip()]}).save_to_disk("verses")
    out = _run(["--task", "hf", "--task-option", "model=tiny", "--task-option", "data=verses", "--task-option",
                "pack=false", "--task-option",
                "seq=16", "--schedule", "auto", "--memory-limit", "1GiB", "--ranks", "2", "--microbatches", "2",
                "--batch-size", "4", "--steps", "2", "--log-every", "0", "--no-tensorboard",
                "--save-pretrained", "auto-tuned"])
    assert "auto (chose " in out and "on pp 2 x dp 1 x tp 1 x ep 1 (ZeRO " in out
    assert ", sequence parallel off), 2 steps" in out
    tuned, info = transformers.AutoModelForCausalLM.from_pretrained(model_dir / "auto-tuned", output_loading_info=True)
    assert not any(info.values()), info  # every tensor in the files, none left over


def test_profile_and_plan_take_a_hugging_face_model(model_dir: Path, monkeypatch: pytest.MonkeyPatch,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    """`profile --task hf` was "must look like path/to/file.py:function", then "cannot split 0 layers"."""
    from duplexpipe.cli import main
    from duplexpipe.planner.profile import load_profile

    monkeypatch.chdir(model_dir)
    hf = ["profile", "--task", "hf", "--task-option", "model=tiny", "--task-option", "data=data.txt", "--task-option",
          "seq=16", "--microbatch", "2", "--repeats", "1"]
    assert main([*hf, "--parts", "4", "-o", "hf.json"]) == 0, capsys.readouterr().err
    assert "tensor-parallel degrees the plan can shard: 2;" in capsys.readouterr().out  # 2 KV heads: not 4
    profile = load_profile(model_dir / "hf.json")
    assert profile.num_parts == 4 and profile.parts[0].param_bytes > profile.parts[1].param_bytes  # + embedding
    assert profile.tp_degrees == (2,) and all(p.tp is not None and p.tp.forward_collectives > 0 for p in profile.parts)
    assert main(["plan", "--profile", "hf.json", "-p", "2", "--batch", "8", "--memory", "1GiB"]) == 0
    assert "best: " in capsys.readouterr().out
    assert main(["plan", "--profile", "hf.json", "-p", "2", "--tp", "2", "--batch", "8", "--memory", "1GiB"]) == 0
    assert "best: " in capsys.readouterr().out
    assert main([*hf, "--parts", "5", "-o", "hf5.json"]) == 2
    assert "tiny has 4 decoder layers: fewer than --parts 5" in capsys.readouterr().err


@pytest.mark.timeout(300)
def test_an_moe_model_trains_with_expert_parallelism_and_loads_back(model_dir: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """duplexpipe train --task hf --ep 2 --dp 2 on a Qwen3-MoE directory (the aux loss on, DualPipeV with the F&B
    overlap), --save-pretrained: transformers loads every expert back, each trained."""
    from _hf_moe_helpers import AUX, set_config, tiny_moe

    monkeypatch.chdir(model_dir)
    tiny_moe("qwen3_moe").save_pretrained(model_dir / "moe")
    set_config(model_dir / "moe", **AUX)
    eos_tokenizer(TEXT).save_pretrained(model_dir / "moe")
    out = _run(["--task", "hf", "--task-option", "model=moe", "--task-option", "data=data.txt", "--task-option",
                "seq=8", "--schedule", "dualpipev", "--ranks", "2", "--dp", "2", "--ep", "2", "--microbatches", "4",
                "--batch-size", "16", "--steps", "2", "--log-every", "0", "--no-tensorboard", "--save-pretrained",
                "moe-tuned"])
    assert "dualpipev on pp 2 x dp 2 x tp 1 x ep 2 (ZeRO 0, sequence parallel off), 2 steps" in out
    tuned, info = transformers.AutoModelForCausalLM.from_pretrained(model_dir / "moe-tuned", output_loading_info=True,
                                                                    experts_implementation="eager")
    assert not any(info.values()), info
    source = transformers.AutoModelForCausalLM.from_pretrained(model_dir / "moe", experts_implementation="eager")
    assert type(tuned) is type(source) and tuned.config.output_router_logits
    experts = [rel(tuned.state_dict()[k][e], v[e]) for k, v in source.state_dict().items() if "experts" in k
               for e in range(v.shape[0])]
    assert len(experts) == 4 * 2 * 4 and min(experts) > 0, experts  # 4 layers x (gate_up, down) x 4 experts


def test_a_tokenizer_larger_than_the_models_vocabulary_is_refused_naming_both_sizes(model_dir: Path) -> None:
    """Ids past the model's vocab_size were an index error deep in the embedding once training ran."""
    wide = model_dir / "wide"
    eos_tokenizer("".join(chr(0x100 + i) for i in range(120))).save_pretrained(wide)  # 122 tokens > VOCAB (96)
    with pytest.raises(ValueError, match=r"vocabulary holds 122 tokens, over the model's vocab_size 96 in .*tiny"):
        check_options(model=str(model_dir / "tiny"), data=str(model_dir / "data.txt"), tokenizer=str(wide))
    with pytest.raises(ValueError, match="vocab_size 96"):
        _task(model_dir, tokenizer=str(wide))


def test_an_empty_data_file_or_one_without_text_is_refused_naming_it(model_dir: Path) -> None:
    (model_dir / "empty.jsonl").write_text("")
    (model_dir / "blank.txt").write_text("\n\n  \n\n")
    with pytest.raises(ValueError, match=r"data file .*empty\.jsonl is empty"):
        check_options(model=str(model_dir / "tiny"), data=str(model_dir / "empty.jsonl"))
    with pytest.raises(ValueError, match=r"data .*blank\.txt holds no document: no text in it"):
        _task(model_dir, data=str(model_dir / "blank.txt"))
