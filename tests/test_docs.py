"""The docs: the site builds with warnings as errors (broken links, anchors and API references fail), its CLI and API
pages are generated from the code, and no tracked page names a folder of the machine it ran on or other users."""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

import duplexpipe

ROOT = Path(__file__).resolve().parents[1]
MACHINE_PATH = re.compile(r"(?<![\w.~])/(tmp|work|home|root|Users|scratch|mnt)/")
"""An absolute path of the machine a figure was measured on (`~/.cache/...`, a user's own, is fine)."""
INTERNAL = re.compile(r"turn [0-9]|issue [0-9]|torch\._[a-z]", re.I)
"""A remark about how the project was built ("turn 2", "issue 29") or a private torch name, which a reader cannot
look up (the check `grep -rniE "turn [0-9]|issue [0-9]|torch\\._[a-z]" docs README.md` makes)."""
ABOUT_USERS = re.compile(r"\b(other|another) (engineer|user|session|team)s?\b|\bengineers?'|\bthe lead\b|quiet-run",
                         re.I)
"""A remark about who else was using the machine."""


def _markdown_files() -> list[Path]:
    """Every .md file git tracks or would add (untracked but not ignored)."""
    listed = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard", "*.md"], cwd=ROOT,
                            capture_output=True, text=True, check=True).stdout.split()
    return [ROOT / name for name in listed if (ROOT / name).is_file()]


def test_no_machine_paths_or_remarks_about_users_in_markdown() -> None:
    files = _markdown_files()
    assert ROOT / "README.md" in files and ROOT / "docs" / "benchmarks.md" in files
    found = [f"{path.relative_to(ROOT)}:{number}: {line.strip()[:100]}"
             for path in files for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1)
             if MACHINE_PATH.search(line) or ABOUT_USERS.search(line)]
    assert not found, "\n".join(found)


def test_no_internal_artefacts_in_the_pages() -> None:
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
    assert ROOT / "docs" / "concepts.md" in pages
    found = [f"{path.relative_to(ROOT)}:{number}: {line.strip()[:100]}" for path in pages
             for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1) if INTERNAL.search(line)]
    assert not found, "\n".join(found)


def _block(page: str, first_line: str) -> tuple[str, str]:
    """The fenced block of docs/`page` whose first line starts with `first_line`, and that whole first line."""
    text = (ROOT / "docs" / page).read_text(encoding="utf-8")
    found = re.search(r"```\w*\n(" + re.escape(first_line) + r"[^\n]*)\n(.*?)```", text, re.S)
    assert found is not None, f"{page}: no block starting {first_line!r}"
    return found.group(1) + "\n" + found.group(2), found.group(1)


def test_the_torchtitan_pages_job_file_is_a_valid_configuration(tmp_path: Path,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """Every key of the page's job file is one `duplexpipe train` takes, with the values the page maps them to."""
    import argparse

    from duplexpipe.cli.train_cmd import add_train_arguments, config_from_args
    from duplexpipe.launch.checks import check_training

    toml, first = _block("from-torchtitan.md", "# titan.toml")
    (tmp_path / "titan.toml").write_text(toml, encoding="utf-8")
    monkeypatch.chdir(tmp_path)
    parser = argparse.ArgumentParser()
    add_train_arguments(parser)
    config = config_from_args(parser.parse_args(first.partition(": ")[2].split()[2:]))
    assert (config.ranks, config.tp, config.dp, config.steps, config.batch_size) == (2, 2, 1, 20, 16)
    assert (config.pipeline.schedule, config.pipeline.num_microbatches) == ("interleaved-1f1b", 4)
    assert config.pipeline.precision.dtype == "bf16" and config.pipeline.activation_checkpointing == "selective"
    assert config.optimizer.lr_schedule == "cosine" and config.checkpoint.save_every == 100
    check_training(config)  # the checks `duplexpipe train` makes before it starts a process


def test_the_torch_pipelining_pages_schedules_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    """The page's Python example runs as written, then its commands, each exit code 0."""
    import shlex

    from duplexpipe.cli import main

    code, _ = _block("from-torch-pipelining.md", "# schedules.py")
    monkeypatch.chdir(tmp_path)
    exec(compile(code, "schedules.py", "exec"), {})  # noqa: S102 - the page's own example
    assert re.match(r"zbv: bubble \d+\.\d%", capsys.readouterr().out)
    commands, _ = _block("from-torch-pipelining.md", "duplexpipe export zbv")
    for line in commands.splitlines():
        words = shlex.split(line.partition("#")[0])
        assert main(words[1:]) == 0, line
    assert "zbv" in capsys.readouterr().out


def test_the_patterns_catch_what_they_are_for() -> None:
    assert MACHINE_PATH.search("`--out /tmp/avh/run3`") and MACHINE_PATH.search("(/work/wt/x/bench-output)")
    assert not MACHINE_PATH.search("`~/.cache/duplexpipe/calibration`") and not MACHINE_PATH.search("pp/dp/tp/")
    assert ABOUT_USERS.search("other engineers' test suites ran") and ABOUT_USERS.search("Another engineer's script")
    assert not ABOUT_USERS.search("the other ranks wait")
    assert INTERNAL.search("as in turn 2") and INTERNAL.search("(issue 29)") and INTERNAL.search("torch._dynamo")
    assert not INTERNAL.search("torch.compile") and not INTERNAL.search("in turn, 3 ranks")


def test_readme_is_a_landing_page() -> None:
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    assert len(text.splitlines()) <= 250
    assert "make demo" in text and "make test" in text and "docs/img/" in text


@pytest.mark.timeout(240)
def test_the_site_builds_strict_with_generated_cli_and_api_pages(tmp_path: Path) -> None:
    if importlib.util.find_spec("mkdocs") is None or importlib.util.find_spec("mkdocstrings") is None:
        pytest.skip("mkdocs is not installed: pip install -e '.[docs]' (make test installs it)")
    site = tmp_path / "site"
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    done = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--quiet", "--config-file",
                           str(ROOT / "mkdocs.yml"), "--site-dir", str(site)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=220)
    assert done.returncode == 0, done.stdout + done.stderr
    cli = (site / "cli" / "index.html").read_text(encoding="utf-8")
    for command in ("train", "plan", "profile", "simulate", "verify"):
        assert f"duplexpipe {command}" in cli and "usage: duplexpipe" in cli
    api = (site / "api" / "index.html").read_text(encoding="utf-8")
    missing = [name for name in duplexpipe.__all__ if f'id="duplexpipe.{name}"' not in api]
    assert not missing, f"public names without an API entry: {missing}"
    assert (site / "index.html").is_file() and (site / "changelog" / "index.html").is_file()
