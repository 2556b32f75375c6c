"""NonFiniteWatch: counts sends holding NaN/inf, warns once naming where, or raises under the strict policy."""

from __future__ import annotations

import warnings

import pytest
import torch

from duplexpipe.comm.codec import bf16_codec
from duplexpipe.comm.nonfinite import NONFINITE_POLICIES, NonFiniteWatch, Unread, check_policy
from duplexpipe.comm.p2p_codecs import Fp8RowCodec, Int8BlockCodec
from duplexpipe.errors import NonFiniteSendError


def _bad() -> torch.Tensor:
    x = torch.ones(3, 8)
    x[2, 5] = float("inf")
    return x


def test_warn_counts_every_event_and_warns_once_naming_where() -> None:
    watch = NonFiniteWatch()
    codec = Fp8RowCodec("e5m2")
    good = torch.ones(3, 8)
    watch.note(codec, good, codec.encode(good), "rank 1: stage 1 microbatch 0")
    assert watch.events == 0 and watch.last == ""
    with pytest.warns(RuntimeWarning, match=r"rank 1: stage 1 microbatch 2 \(gradients\): a tensor sent with "
                      r"codec 'fp8-e5m2-row' held NaN or inf \(1 scaled rows/blocks\)"):
        watch.note(codec, _bad(), codec.encode(_bad()), "rank 1: stage 1 microbatch 2 (gradients)")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a second warning would raise here
        watch.note(codec, _bad(), codec.encode(_bad()), "rank 1: stage 1 microbatch 3 (gradients)")
    assert watch.events == 2 and "microbatch 3" in watch.last


def test_raise_names_the_send() -> None:
    watch = NonFiniteWatch("raise")
    codec = Int8BlockCodec(8)
    with pytest.raises(NonFiniteSendError, match=r"rank 0: stage 0 microbatch 4: a tensor sent with codec "
                       r"'int8-block8' held NaN or inf \(1 scaled rows/blocks\)"):
        watch.note(codec, _bad(), codec.encode(_bad()), "rank 0: stage 0 microbatch 4")
    assert watch.events == 1


def test_codecs_without_a_counter_are_checked_element_by_element() -> None:
    watch = NonFiniteWatch("raise")
    codec = bf16_codec()  # inf stays inf in bf16: nothing is rescaled, but the event is still reported
    x = _bad()
    x[0, 0] = float("nan")
    with pytest.raises(NonFiniteSendError, match=r"codec 'cast-bfloat16' held NaN or inf \(2 elements\)"):
        watch.note(codec, x, codec.encode(x), "here")


def test_read_reports_what_was_kept() -> None:
    watch = NonFiniteWatch()
    codec = Fp8RowCodec()
    x = _bad()
    unread: list[Unread] = [("kept", codec.name, codec.nonfinite(codec.encode(x)), "scaled rows/blocks")]
    with pytest.warns(RuntimeWarning, match="kept: a tensor sent with codec 'fp8-e4m3-row'"):
        watch.read(unread)
    assert watch.events == 1


def test_policies_are_checked() -> None:
    assert NONFINITE_POLICIES == ("warn", "raise")
    assert check_policy("raise", "x") == "raise"
    with pytest.raises(ValueError, match=r"RuntimeConfig.nonfinite_sends must be one of \['warn', 'raise'\], "
                       "got 'ignore'"):
        check_policy("ignore", "RuntimeConfig.nonfinite_sends")
    with pytest.raises(ValueError, match="the non-finite policy must be one of"):
        NonFiniteWatch("strict")


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_on_cuda_the_warn_policy_keeps_counts_until_flush() -> None:
    watch = NonFiniteWatch()
    codec = Fp8RowCodec()
    x = _bad().cuda()
    watch.note(codec, x, codec.encode(x), "on the gpu")
    assert watch.events == 0 and len(watch._pending) == 1  # no sync at the send
    with pytest.warns(RuntimeWarning, match="on the gpu: a tensor sent with codec 'fp8-e4m3-row'"):
        watch.flush()
    assert watch.events == 1
