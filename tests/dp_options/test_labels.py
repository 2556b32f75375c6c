"""Tests for duplexpipe.dp_options.labels: options written as text are parsed as literals only, never run."""

from __future__ import annotations

import pytest

from duplexpipe.dp_options.compression import DGCOptions, PowerSGDOptions, compression_options
from duplexpipe.dp_options.labels import MAX_LABEL_CHARS, build_options, parse_label, parse_labels


def test_labels_are_names_with_literal_options() -> None:
    assert parse_labels("fp8, int8(block=128)") == [("fp8", {}), ("int8", {"block": 128})]
    assert parse_label("powersgd(rank=1, warm_start=false)") == ("powersgd", {"rank": 1, "warm_start": False})
    assert parse_label("FP8") == ("FP8", {})  # names as written: each reader decides on case
    assert parse_label("fp8(fmt=e5m2)") == ("fp8", {"fmt": "e5m2"})  # a bare word is text
    assert parse_label("fp8(fmt='e5m2', seed=None)") == ("fp8", {"fmt": "e5m2", "seed": None})


@pytest.mark.parametrize("text", ["int8(128)", "int8(block=1+1)", "__import__('os').system('true')", "a b",
                                  "int8(**opts)", "x.y"])
def test_anything_but_literals_is_refused_naming_the_text(text: str) -> None:
    with pytest.raises(ValueError, match="bad options"):
        parse_labels(text)


def test_limits_and_unknown_options() -> None:
    with pytest.raises(ValueError, match="over the limit"):
        parse_labels("a" * (MAX_LABEL_CHARS + 1))
    with pytest.raises(ValueError, match="expected one NAME"):
        parse_label("fp8, none")
    assert build_options(DGCOptions, {"ratio": 0.01}, "dgc").ratio == 0.01
    assert compression_options("PowerSGD(rank=1)") == PowerSGDOptions(rank=1)
    with pytest.raises(ValueError, match=r"dgc\(x=1\): unknown option\(s\) \['x'\]; it takes ratio"):
        build_options(DGCOptions, {"x": 1}, "dgc(x=1)")


def test_a_run_of_labels_separated_by_slashes_is_one_text_value() -> None:
    name, options = parse_label("adaptive(ladder=none/bf16/int8(block=128), patience=2)")
    assert (name, options) == ("adaptive", {"ladder": "none/bf16/int8(block=128)", "patience": 2})
    with pytest.raises(ValueError, match="expected NAME or NAME\\(key=value, ...\\)"):
        parse_label("adaptive(ladder=none/3)")  # each part must be a label
