"""benchmarks.spawn_bench: the rows from given times, one real probe, and the config's refusals."""

from __future__ import annotations

import pytest

from benchmarks import spawn_bench as bench


def test_rows_give_the_median_and_range_of_each_launch() -> None:
    times = {"forkserver": [{"first_s": f, "second_s": s, "import_s": 1.0} for f, s in ((3.0, 1.0), (5.0, 0.9),
                                                                                      (4.0, 1.2))],
             "spawn": [{"first_s": 6.0, "second_s": 5.5, "import_s": 1.0}]}
    result = {"config": {"reps": 3, "ranks": 4}, "times": times}
    rows = {r["method"]: r for r in bench.rows(result)}
    assert rows["forkserver"]["first_s"] == (4.0, 3.0, 5.0) and rows["forkserver"]["second_s"] == (1.0, 0.9, 1.2)
    assert rows["spawn"]["first_s"] == (6.0, 6.0, 6.0)
    _, table = bench.report(result)
    assert [r[0] for r in table[1:]] == ["forkserver (default)", "spawn"] and len(set(map(len, table))) == 1


@pytest.mark.timeout(120)
def test_a_probe_times_two_launches_in_a_fresh_interpreter() -> None:
    got = bench.probe("forkserver", 2)
    assert set(got) == {"import_s", "first_s", "second_s"} and all(v > 0 for v in got.values())


def test_bad_counts_are_refused() -> None:
    with pytest.raises(ValueError, match="reps and ranks must be >= 1"):
        bench.SpawnConfig(reps=0)
