"""The adaptive-compression controller on scripted measurements: exposed keys move up, hidden ones down, no
flapping under noise or at a knee, the loss guard, its options and their text form."""

from __future__ import annotations

import random
from typing import Any

import pytest

from duplexpipe.comm.adaptive import URGENT, URGENT_RUN, Controller
from duplexpipe.dp_options.compression import AdaptiveOptions, Int8Options, NoCompression, compression_options

STEP_S = 1.0


def _run(ctl: Controller, exposures: list[dict[str, float]]) -> list[list[int]]:
    """Rungs after each step."""
    out = []
    for exposed in exposures:
        ctl.observe(STEP_S, exposed)
        out.append(ctl.rungs())
    return out


def _on(ctl: Controller, steps: int, exposure: dict[str, list[float]]) -> None:
    """`steps` steps where each key's exposed seconds depend on its rung (exposure[key][rung])."""
    for _ in range(steps):
        ctl.observe(STEP_S, {k: by_rung[ctl.rung(k)] for k, by_rung in exposure.items()})


def test_exposed_moves_up_and_hidden_moves_down_after_patience() -> None:
    opts = AdaptiveOptions(ladder="none/bf16/int8", start="bf16", patience=3)
    ctl = Controller(opts, ["bucket 0", "bucket 1"])
    rungs = _run(ctl, [{"bucket 0": 0.05, "bucket 1": 0.0}] * 3)  # exposed, not urgently (0.02 < 0.05 <= 0.1)
    assert rungs == [[1, 1], [1, 1], [2, 0]]
    assert [(d.key, d.before, d.after) for d in ctl.log] == [("bucket 0", "bf16", "int8"), ("bucket 1", "bf16", "none")]
    _on(ctl, 20, {"bucket 0": [0.05, 0.05, 0.01], "bucket 1": [0.0, 0.0, 0.0]})
    assert ctl.rungs() == [2, 0] and len(ctl.log) == 2  # int8 lowered bucket 0's exposure: kept; the ends hold


def test_a_rung_that_does_not_lower_exposure_is_left_and_retried_ever_more_rarely() -> None:
    """int8's own compute costs what its bytes save: the key goes back to bf16 and retries after 3, 6, 12, ..."""
    opts = AdaptiveOptions(ladder="none/bf16/int8", start="bf16", patience=3, max_hold=24)
    ctl = Controller(opts, ["k"])
    _on(ctl, 200, {"k": [0.5, 0.3, 0.3]})
    ups = [d.step for d in ctl.log if d.after == "int8"]
    assert all(d.after in ("int8", "bf16") for d in ctl.log) and ctl.rung("k") in (1, 2)
    gaps = [b - a for a, b in zip(ups, ups[1:], strict=False)]
    assert gaps == sorted(gaps) and gaps[-1] >= 24 and len(ups) <= 200 // 24 + 4
    assert "did not lower the exposed time" in ctl.log[1].reason


def test_band_between_thresholds_and_broken_runs_do_not_move() -> None:
    opts = AdaptiveOptions(ladder="none/bf16/int8", start="bf16", patience=3, up=0.02, down=0.005)
    ctl = Controller(opts, ["k"])
    rng = random.Random(0)
    band = [{"k": rng.uniform(0.0051, 0.02)} for _ in range(100)]
    spikes = [{"k": 0.5 if i % 3 == 2 else 0.0} for i in range(100)]  # exposed 1 step in 3: never 3 in a row
    mixed = [{"k": 0.5 if i % 3 == 0 else 0.01} for i in range(100)]
    for script in (band, spikes, mixed):
        _run(ctl, script)
    assert ctl.log == [] and ctl.rungs() == [1]


def test_a_key_at_the_knee_probes_down_ever_more_rarely() -> None:
    """Exposed on the lighter rung, hidden on the heavier: each failed probe doubles the wait before the next."""
    opts = AdaptiveOptions(ladder="none/int8", start="int8", patience=2, max_hold=32)
    ctl = Controller(opts, ["k"])
    for _ in range(400):
        ctl.observe(STEP_S, {"k": 0.5 if ctl.rung("k") == 0 else 0.0})
    downs = [d.step for d in ctl.log if d.after == "none"]
    gaps = [b - a for a, b in zip(downs, downs[1:], strict=False)]
    assert gaps == sorted(gaps) and gaps[-1] >= 32  # backing off, up to max_hold
    assert len(ctl.log) <= 2 * (len(downs) + 1) and len(downs) <= 400 // 32 + 6


def test_noisy_exposure_on_a_changing_link_settles() -> None:
    """A link that becomes slow: the key climbs once and stays despite noise; fast again: it comes back down."""
    opts = AdaptiveOptions(ladder="none/bf16/int8", patience=3)
    ctl = Controller(opts, ["k"])
    rng = random.Random(1)
    for _ in range(40):  # slow: exposed on none and bf16, less so on int8
        ctl.observe(STEP_S, {"k": [0.2, 0.1, 0.04][ctl.rung("k")] + rng.uniform(-0.01, 0.01)})
    assert ctl.rung("k") == 2 and len(ctl.log) == 2
    _run(ctl, [{"k": rng.uniform(0.0, 0.004)} for _ in range(40)])
    assert ctl.rung("k") == 0 and len(ctl.log) == 4


def test_loss_guard_closes_the_top_rung() -> None:
    opts = AdaptiveOptions(ladder="none/bf16/int8", start="int8", guard=0.05)
    ctl = Controller(opts, ["k"])
    for step in range(40):
        loss = 2.0 - 0.01 * step if step < 20 else 1.8 + 0.05 * (step - 20)
        ctl.observe(STEP_S, {"k": 0.5}, loss)
    assert ctl.ceiling < 2 and ctl.rung("k") <= ctl.ceiling
    assert any("loss guard" in d.reason for d in ctl.log)


def test_state_round_trips() -> None:
    opts = AdaptiveOptions(ladder="none/bf16/int8", patience=2)
    one, two = Controller(opts, ["a", "b"]), Controller(opts, ["a", "b"])
    _run(one, [{"a": 0.5, "b": 0.0}] * 5)
    two.load_state_dict(one.state_dict())
    script = [{"a": 0.0, "b": 0.5}] * 7
    assert _run(one, script) == _run(two, script)


def test_options_parse_and_refuse_with_the_value() -> None:
    opts = compression_options("adaptive(ladder=none/int8(block=128), patience=2)")
    assert isinstance(opts, AdaptiveOptions) and opts.patience == 2
    assert opts.gradient_rungs() == (NoCompression(), Int8Options(block=128))
    assert compression_options("adaptive") == AdaptiveOptions()
    for text, message in [("adaptive(ladder=none)", "at least two rungs"),
                          ("adaptive(ladder=none/dgc)", "'dgc' cannot be a rung"),
                          ("adaptive(ladder=none/int4)", "unknown gradient compression 'int4'"),
                          ("adaptive(start=fp8)", "'fp8' is not a rung"),
                          ("adaptive(up=0.01, down=0.02)", "down < up"),
                          ("adaptive(patience=0)", "patience must be an int >= 1, got 0")]:
        with pytest.raises(ValueError, match=message):
            compression_options(text)
    with pytest.raises(ValueError, match="no exposure measured for \\['b'\\]"):
        Controller(AdaptiveOptions(), ["a", "b"]).observe(STEP_S, {"a": 0.0})


def test_with_a_lag_the_measurement_taken_before_a_move_is_not_held_against_it() -> None:
    """The agreement decides a step late: the first measurement after a move is still of the old rung."""
    opts = AdaptiveOptions(ladder="none/int8", patience=2)
    script = [0.5, 0.5, 0.9, 0.2, 0.2]  # int8 (still exposed, less) takes effect from the 4th measurement on
    late, prompt = Controller(opts, ["k"], lag=1), Controller(opts, ["k"])
    for exposed in script:
        late.observe(STEP_S, {"k": exposed})
        prompt.observe(STEP_S, {"k": exposed})
    assert late.rung("k") == 1 and len(late.log) == 1  # kept: the 0.9 just after the move was skipped
    assert prompt.rung("k") == 0 and "did not lower" in prompt.log[1].reason  # judged on the stale 0.9


def _agreed(ctl: Controller, exposure: Any, steps: int, rng: random.Random) -> list[int]:
    """Run `steps` steps as the agreement does (each step's measurement decided on at the end of the next step, its
    moves applied from the step after); exposure(step, rung) -> exposed seconds. The rung each step used."""
    used: list[int] = []
    measured: list[float] = []
    for step in range(steps):
        used.append(ctl.rung("k"))
        measured.append(exposure(step, used[-1]) * rng.uniform(0.8, 1.2))
        if step > 0:
            ctl.observe(STEP_S, {"k": measured[step - 1]})
    return used


def test_a_link_that_becomes_slow_is_climbed_within_a_few_steps_and_held_under_noise() -> None:
    """At step 20 the link drops: none is exposed 60% of the step, bf16 30%, int8 5%. Through the agreement's delay
    the key compresses from the 3rd step after the drop and reaches int8 by the 7th (waiting out patience and a
    step per move, it took 4 and 10), then holds int8 under 20% noise."""
    opts = AdaptiveOptions(ladder="none/bf16/int8", patience=3)
    ctl = Controller(opts, ["k"], lag=1)
    drop = 20
    used = _agreed(ctl, lambda step, rung: 0.0 if step < drop else [0.6, 0.3, 0.05][rung], 120, random.Random(2))
    assert used[:drop + 2] == [0] * (drop + 2) and used[drop + 2 + URGENT_RUN - 1] == 1
    assert used.index(2) == drop + 2 + URGENT_RUN - 1 + 1 + opts.patience
    assert set(used[used.index(2):]) == {2} and len(ctl.log) == 2


def test_a_stalled_step_during_a_trial_does_not_undo_the_move() -> None:
    """One step the machine stalled (0.9 s) among the three that judge bf16: the median keeps the move."""
    ctl = Controller(AdaptiveOptions(ladder="none/bf16/int8", patience=3), ["k"])
    _run(ctl, [{"k": 0.05}] * 3 + [{"k": 0.01}, {"k": 0.9}, {"k": 0.01}])
    assert ctl.rung("k") == 1 and len(ctl.log) == 1


def test_urgent_exposure_moves_after_two_steps_but_one_urgent_step_alone_does_not() -> None:
    opts = AdaptiveOptions(ladder="none/bf16/int8", patience=3)
    ctl = Controller(opts, ["k"])
    _run(ctl, [{"k": 0.5}, {"k": 0.0}, {"k": 0.5}, {"k": 0.05}, {"k": 0.0}])  # urgent runs of 1
    assert ctl.log == []
    _run(ctl, [{"k": URGENT * opts.up * 1.01}] * URGENT_RUN)
    assert ctl.rung("k") == 1 and "(over 10%) for 2 steps" in ctl.log[0].reason


def test_a_probe_down_that_delays_the_reductions_behind_it_is_undone_ever_more_rarely() -> None:
    """Bucket a never waits itself, but on none its bytes delay bucket b queued behind it on the link (b, on the top
    rung, exposed 0.2 s with a on int8 and 0.3 s with a on none): each probe of a down is undone and the next comes
    twice as late, so a spends nearly all steps on int8. (The same with a step that did not get slower: the probe
    holds.)"""
    opts = AdaptiveOptions(ladder="none/int8", start="int8", patience=2, max_hold=32)
    ctl = Controller(opts, ["a", "b"])
    on_int8 = 0
    for _ in range(300):
        on_int8 += ctl.rung("a") == 1
        b = 0.2 if ctl.rung("a") == 1 else 0.3
        ctl.observe(STEP_S + b, {"a": 0.0, "b": b})  # the step waits for b
    downs = [d.step for d in ctl.log if d.after == "none"]
    gaps = [b - a for a, b in zip(downs, downs[1:], strict=False)]
    assert all(d.key == "a" for d in ctl.log) and ctl.rung("b") == 1
    assert all("the group's exposed time rose" in d.reason for d in ctl.log if d.after == "int8")
    assert gaps == sorted(gaps) and gaps[-1] >= 32 and on_int8 >= 0.9 * 300
    held = Controller(opts, ["a", "b"])
    for _ in range(30):
        held.observe(STEP_S, {"a": 0.0, "b": 0.2 if held.rung("a") == 1 else 0.3})
    assert [(d.key, d.after) for d in held.log] == [("a", "none")]


def test_a_move_up_that_lowers_the_exposure_but_slows_the_step_is_undone() -> None:
    """A moderate link: int8 hides the transfer but its own compute costs more than the transfer it saved (the step
    takes 1.3 s on int8, 1.1 s on bf16): the key goes back to bf16 and retries ever more rarely."""
    opts = AdaptiveOptions(ladder="none/bf16/int8", start="bf16", patience=2, max_hold=16)
    ctl = Controller(opts, ["k"])
    on_bf16 = 0
    for _ in range(200):
        rung = ctl.rung("k")
        on_bf16 += rung == 1
        ctl.observe([1.3, 1.1, 1.3][rung], {"k": [0.3, 0.1, 0.0][rung]})
    assert all(d.after in ("bf16", "int8") for d in ctl.log) and on_bf16 >= 0.85 * 200
    assert "int8 made the step slower (1300.00 ms vs 1100.00 ms)" in ctl.log[1].reason


def test_a_move_up_that_lowers_the_groups_exposure_is_kept_though_the_keys_own_rose() -> None:
    """int8's second collective queues behind the other buckets' transfers: bucket a's own exposure rises on int8
    (0.05 -> 0.08 s), but the group's (the wait for b, queued behind a's bytes) falls: the move is kept."""
    opts = AdaptiveOptions(ladder="none/int8", patience=2)
    ctl = Controller(opts, ["a", "b"])
    for _ in range(60):
        a, b = ctl.rung("a"), ctl.rung("b")
        ctl.observe(STEP_S, {"a": 0.08 if a else 0.05, "b": 0.3 - 0.1 * a - 0.1 * b})
    assert ctl.rungs() == [1, 1] and [(d.key, d.after) for d in ctl.log] == [("a", "int8"), ("b", "int8")]


def test_buckets_sharing_a_link_climb_together_while_the_group_waits() -> None:
    """Buckets a and b share a link: b's reduction shows the wait (0.3 s) though a's bytes queue in front of it.
    Shared, a climbs with b (and stays while the group waits); independent, a (never waiting itself) stays down."""
    opts = AdaptiveOptions(ladder="none/int8", patience=2)
    for shared, rungs in ((True, [1, 1]), (False, [0, 1])):
        ctl = Controller(opts, ["a", "b"], shared=shared)
        for _ in range(40):
            b = 0.3 - 0.1 * ctl.rung("a") - 0.1 * ctl.rung("b")
            ctl.observe(STEP_S + b, {"a": 0.0, "b": b})
        assert ctl.rungs() == rungs


def test_a_link_that_becomes_slow_lifts_the_cap_a_failed_trial_set() -> None:
    """On a fast link bf16 did not help and was capped for up to 64 steps; the link then drops and the key is
    urgently exposed: it climbs at once instead of waiting out the cap."""
    opts = AdaptiveOptions(ladder="none/bf16", patience=2)
    ctl = Controller(opts, ["k"])
    _run(ctl, [{"k": 0.03}] * 4)  # exposed a little, on none and bf16 alike: bf16 is left and capped
    assert ctl.rung("k") == 0 and "did not lower" in ctl.log[-1].reason
    _run(ctl, [{"k": 0.5}] * URGENT_RUN)
    assert ctl.rung("k") == 1 and len(ctl.log) == 3


def test_a_trial_the_link_dropped_during_does_not_cap_the_rung_it_tried() -> None:
    """On a fast link int8 does not lower bf16's exposure and is capped ever longer; the link then drops 20x one
    step into int8's fifth trial (exposure in proportion to a rung's bytes: none 4, bf16 2, int8 1 units). Judged
    against the steps before the drop the trial fails and the key goes back to bf16, but bf16 is now exposed far
    above what it was before the trial, so int8 is tried again after URGENT_RUN steps and kept. (Judging the cap by
    the failed trial's own post-drop exposure, int8 at exactly half of bf16's never looked "twice as exposed", and
    the key waited out the cap on bf16.)"""
    opts = AdaptiveOptions(ladder="none/bf16/int8", start="bf16", patience=3)
    ctl = Controller(opts, ["k"], lag=1)
    drop: list[int] = []

    def exposure(step: int, rung: int) -> float:
        if not drop and [d.after for d in ctl.log].count("int8") == 5 and ctl.log[-1].after == "int8":
            drop.append(step + 1)
        return [0.04, 0.03, 0.03][rung] if not drop or step < drop[0] else 0.4 * [4, 2, 1][rung]

    class Exact(random.Random):
        def uniform(self, a: float, b: float) -> float:
            return 1.0

    used = _agreed(ctl, exposure, 120, Exact())
    back = used.index(1, drop[0])  # the failed trial undone
    assert "int8 did not lower the exposed time" in ctl.log[-2].reason and ctl.log[-2].step > drop[0]
    assert used.index(2, back) - back == 1 + URGENT_RUN and set(used[used.index(2, back):]) == {2}, used
