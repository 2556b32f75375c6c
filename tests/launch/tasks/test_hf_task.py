"""Tests for duplexpipe.launch.tasks.hf: `duplexpipe train --task hf` fine-tunes a transformers directory on a text
file with its own tokenizer, and `--save-pretrained` hands transformers the result (the README's two commands)."""

from __future__ import annotations

import pytest

pytest.importorskip("transformers")

import io  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402
from _hf_helpers import char_tokenizer, rel, tiny_llama, transformers  # noqa: E402

from duplexpipe.cli.train_cmd import add_train_arguments, train_main  # noqa: E402
from duplexpipe.launch.tasks.gpt import corpus_text  # noqa: E402
from duplexpipe.launch.tasks.hf import check_options, hf_task  # noqa: E402

TEXT = corpus_text()[:4000]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("hf-task")
    transformers.logging.set_verbosity_error()
    tiny_llama(layers=4).save_pretrained(root / "tiny")
    char_tokenizer(TEXT).save_pretrained(root / "tiny")
    (root / "data.txt").write_text(TEXT, encoding="utf-8")
    return root


def test_batches_are_windows_of_the_tokenized_text_and_the_same_every_time(model_dir: Path) -> None:
    task = hf_task(model=str(model_dir / "tiny"), data=str(model_dir / "data.txt"), seq=16, seed=3)
    x, y = task.batch(5, 4)
    assert x.shape == (4, 16) and torch.equal(x, y) and torch.equal(task.batch(5, 4)[0], x)
    assert not torch.equal(task.batch(6, 4)[0], x)
    tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir / "tiny")
    assert tokenizer.decode(x[0]).replace(" ", "") in TEXT.replace(" ", "")
    assert task.pretrained == str(model_dir / "tiny") and task.item_name == "tokens"


def test_bad_options_are_named(model_dir: Path) -> None:
    with pytest.raises(ValueError, match="data file nowhere.txt does not exist"):
        check_options(model=str(model_dir / "tiny"), data="nowhere.txt")
    with pytest.raises(ValueError, match="seq must be an integer >= 2"):
        check_options(model=str(model_dir / "tiny"), data=str(model_dir / "data.txt"), seq=1)
    with pytest.raises(ValueError, match="dtype must be one of float32"):
        check_options(model=str(model_dir / "tiny"), data=str(model_dir / "data.txt"), dtype="int4")
    with pytest.raises(ValueError, match="fewer than a window"):
        hf_task(model=str(model_dir / "tiny"), data=str(model_dir / "data.txt"), seq=10_000)


@pytest.mark.timeout(300)
def test_train_then_load_back_in_transformers(model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """duplexpipe train --task hf ... --save-pretrained tuned; then AutoModelForCausalLM.from_pretrained("tuned").
    With --schedule auto: the planner may merge the model's parts, and the export names them as the model does."""
    monkeypatch.chdir(model_dir)
    import argparse

    parser = argparse.ArgumentParser()
    add_train_arguments(parser)
    args = parser.parse_args(["--task", "hf", "--task-option", "model=tiny", "--task-option", "data=data.txt",
                              "--task-option", "seq=16", "--schedule", "auto", "--memory-limit", "1GiB", "--ranks", "2",
                              "--microbatches", "2",
                              "--batch-size", "4", "--steps", "3", "--log-every", "0", "--no-tensorboard",
                              "--save-pretrained", "tuned"])
    out = io.StringIO()
    assert train_main(args, out) == 0
    assert "auto (chose " in out.getvalue() and "on 2 ranks x 1 dp, 3 steps" in out.getvalue()
    tuned, info = transformers.AutoModelForCausalLM.from_pretrained(model_dir / "tuned", output_loading_info=True)
    assert not any(info.values()), info  # every tensor in the files, none left over
    source = transformers.AutoModelForCausalLM.from_pretrained(model_dir / "tiny")
    assert type(tuned) is type(source) and tuned.dtype == source.dtype
    moved = [rel(tuned.state_dict()[k], v) for k, v in source.state_dict().items()]
    assert min(moved) > 0 and max(moved) < 0.5, moved  # every tensor trained, none blown up
    tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir / "tuned")  # copied from the source
    ids = tokenizer("In the", return_tensors="pt")["input_ids"]
    assert tuned.generate(ids, max_new_tokens=4, min_new_tokens=4, do_sample=False).shape == (1, ids.shape[1] + 4)


@pytest.mark.timeout(300)
def test_an_moe_model_trains_with_expert_parallelism_and_loads_back(model_dir: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """duplexpipe train --task hf --ep 2 --dp 2 on a Qwen3-MoE directory (the aux loss on, DualPipeV with the F&B
    overlap), --save-pretrained: transformers loads every expert back, each trained."""
    from _hf_moe_helpers import AUX, set_config, tiny_moe

    monkeypatch.chdir(model_dir)
    tiny_moe("qwen3_moe").save_pretrained(model_dir / "moe")
    set_config(model_dir / "moe", **AUX)
    char_tokenizer(TEXT).save_pretrained(model_dir / "moe")
    import argparse

    parser = argparse.ArgumentParser()
    add_train_arguments(parser)
    args = parser.parse_args(["--task", "hf", "--task-option", "model=moe", "--task-option", "data=data.txt",
                              "--task-option", "seq=8", "--schedule", "dualpipev", "--ranks", "2", "--dp", "2", "--ep",
                              "2", "--microbatches", "4", "--batch-size", "16", "--steps", "2", "--log-every", "0",
                              "--no-tensorboard", "--save-pretrained", "moe-tuned"])
    out = io.StringIO()
    assert train_main(args, out) == 0
    assert "dualpipev on 2 ranks x 2 dp, 2 steps" in out.getvalue()
    tuned, info = transformers.AutoModelForCausalLM.from_pretrained(model_dir / "moe-tuned", output_loading_info=True,
                                                                    experts_implementation="eager")
    assert not any(info.values()), info
    source = transformers.AutoModelForCausalLM.from_pretrained(model_dir / "moe", experts_implementation="eager")
    assert type(tuned) is type(source) and tuned.config.output_router_logits
    experts = [rel(tuned.state_dict()[k][e], v[e]) for k, v in source.state_dict().items() if "experts" in k
               for e in range(v.shape[0])]
    assert len(experts) == 4 * 2 * 4 and min(experts) > 0, experts  # 4 layers x (gate_up, down) x 4 experts
