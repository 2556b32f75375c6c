"""benchmarks.framework: a part's config changed by --set, its report rendered as text and as markdown."""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from benchmarks import framework
from benchmarks.framework import Part, markdown_table, render, text_table, with_settings


@dataclass(frozen=True)
class _Config:
    steps: int = 3
    rate: float = 1.5
    name: str = "x"
    schedules: tuple[str, ...] = ("1f1b",)
    pairs: tuple[tuple[str, int], ...] = (("1f1b", 4),)
    options: dict[str, int] | None = None

    def __post_init__(self) -> None:
        if self.steps < 1:
            raise ValueError(f"steps must be >= 1, got {self.steps}")


def test_settings_take_json_comma_lists_and_text_by_the_field_they_replace() -> None:
    got = with_settings(_Config(), ["steps=7", "rate=2", "name=12", "schedules=zbv,dualpipe",
                                    'pairs=[["gpipe", 8]]', 'options={"a": 1}'])
    assert got == _Config(7, 2.0, "12", ("zbv", "dualpipe"), (("gpipe", 8),), {"a": 1})
    assert isinstance(got.rate, float) and isinstance(got.name, str)
    assert with_settings(_Config(), ["schedules=[]"]).schedules == ()
    assert with_settings(_Config(), []) == _Config()


def test_tuple_settings_take_empty_tuples_python_literals_and_colon_items() -> None:
    assert with_settings(_Config(), ["pairs=()", "schedules=()"]) == _Config(schedules=(), pairs=())
    assert with_settings(_Config(), ["pairs=gpipe:8,zbv:2"]).pairs == (("gpipe", 8), ("zbv", 2))
    assert with_settings(_Config(), ["pairs=(('gpipe', 8),)"]).pairs == (("gpipe", 8),)
    assert with_settings(_Config(), ['pairs=["gpipe", 8]']).pairs == (("gpipe", 8),)  # one item, given flat
    assert with_settings(_Config(), ["pairs=zbv:2"]).pairs == (("zbv", 2),)


def test_settings_refuse_an_unknown_field_and_what_the_config_refuses() -> None:
    with pytest.raises(ValueError, match="FIELD one of"):
        with_settings(_Config(), ["bogus=1"])
    with pytest.raises(ValueError, match="FIELD one of"):
        with_settings(_Config(), ["steps"])
    with pytest.raises(ValueError, match="steps must be >= 1"):
        with_settings(_Config(), ["steps=0"])


def test_a_report_renders_the_same_cells_as_text_and_as_markdown() -> None:
    table = [["a", "bb"], ["1", "**no**"], ["333", "4"]]
    text = text_table(table).splitlines()
    assert len(text) == 4 and set(text[1]) <= {"-", " "} and "**" not in text_table(table)
    assert [line.split() for line in text[2:]] == [["1", "no"], ["333", "4"]]
    md = markdown_table(table).splitlines()
    assert len(md) == 4 and md[1].count("---") == 2 and "**no**" in md[2]
    blocks = ["### Heading", "a **bold** sentence", table]
    plain, marked = render(blocks, markdown=False).split("\n\n"), render(blocks, markdown=True).split("\n\n")
    assert len(plain) == len(marked) == 3
    assert plain[0] == "Heading" and marked[0] == "### Heading" and "**" not in plain[1]


def test_a_part_names_its_docs_block() -> None:
    part = Part("p", "P", _Config(), _Config(steps=1), lambda c: {"steps": c.steps}, lambda r: [str(r["steps"])])
    assert part.block_of({}) == "p" and part.text(part.run(part.quick)) == "1" and part.figures({}, "x") == []
    named = Part("p", "P", _Config(), _Config(), part.run, part.report, block=lambda r: f"b{r.get('n', 0)}")
    assert named.block_of({"n": 2}) == "b2" and named.block_of({}) == "b0"


def test_bars_label_every_value_and_leave_a_missing_one_out(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    made = framework.figure
    drawn: list[Any] = []

    def keep(*args: Any, **kwargs: Any) -> Any:
        drawn.append(made(*args, **kwargs))
        return drawn[-1]

    monkeypatch.setattr(framework, "figure", keep)
    framework.bars(str(tmp_path / "b.png"), ["a", "b"], {"x": [0.5, 1.25], "y": [0.75, math.nan]}, 1.0, "parity",
                   "ratio", "title")
    labels = [t.get_text() for t in drawn[0].axes[0].texts]
    assert sorted(labels) == ["0.50", "0.75", "1.25", "parity"]  # no "nan", no "0.00" for the missing bar
    assert (tmp_path / "b.png").stat().st_size > 0
