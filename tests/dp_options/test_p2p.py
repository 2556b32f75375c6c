"""Tests for duplexpipe.dp_options.p2p: `p2p_compression` read into (activation, gradient) directions and checked
without torch; an object given is passed on for the codecs' module to check."""

from __future__ import annotations

import pytest

from duplexpipe.dp_options.compression import AdaptiveOptions
from duplexpipe.dp_options.p2p import Given, holds_objects, p2p_labels


def test_names_pairs_and_options_become_checked_labels() -> None:
    assert p2p_labels(None) == (None, None) and p2p_labels("none") == (None, None)
    assert p2p_labels("fp8") == (("fp8", {"fmt": "e4m3"}), ("fp8", {"fmt": "e5m2"}))
    assert p2p_labels("int8(block=128)") == (("int8", {"block": 128}),) * 2
    assert p2p_labels("fp8, none") == (("fp8", {"fmt": "e4m3"}), None)
    assert p2p_labels(("bf16", None)) == (("bf16", {}), None)
    adaptive = p2p_labels("adaptive(ladder=none/bf16/int8)")
    assert isinstance(adaptive, AdaptiveOptions) and adaptive.rung_labels == ("none", "bf16", "int8")
    assert not holds_objects(adaptive) and not holds_objects(p2p_labels("fp8, none"))


def test_an_object_is_passed_on_with_where_it_stood() -> None:
    codec = object()
    assert p2p_labels(codec, "P.x") == (Given(codec, "P.x", pair_item=False),) * 2
    pair = p2p_labels(("fp8", codec), "P.x")
    assert pair == (("fp8", {"fmt": "e4m3"}), Given(codec, "P.x[1] (gradients)", pair_item=True))
    assert holds_objects(pair)


@pytest.mark.parametrize("spec, message", [
    ("nope", "unknown p2p_compression 'nope'; expected None, one of ['bf16', 'fp8', 'int8']"),
    ("int8(block=0)", "Int8BlockCodec block must be an int >= 1, got 0"),
    ("int8(stochastic_seed=1.5)", "Int8BlockCodec stochastic_seed must be an int or None, got 1.5"),
    ("fp8(fmt='e9')", "unknown fp8 format 'e9'; expected one of ['e4m3', 'e5m2']"),
    ("bf16(x=1)", "p2p_compression 'bf16(x=1)': unknown option(s) ['x']; bf16 takes no options"),
    ("adaptive(ladder=none/zz)", "adaptive p2p_compression ladder rung 'zz': unknown p2p_compression 'zz'"),
    ("fp8, bf16, none", "P.x as a pair must be 'activation, gradient', got 3 items"),
    (("fp8",), "P.x as a pair must be (activation, gradient), got 1 items"),
])
def test_bad_values_name_the_value_and_the_choices(spec: object, message: str) -> None:
    with pytest.raises(ValueError) as info:
        p2p_labels(spec, "P.x")
    assert message in str(info.value)
