"""Profile: JSON round trip without torch, one-line errors for bad files, scaling and grouping of parts."""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from duplexpipe.errors import ProfileError
from duplexpipe.planner.profile import PartProfile, Profile, RuntimeOverhead, load_profile, save_profile


def part(f: float = 1.0, i: float = 2.0, w: float = 1.0, act: int = 100, params: int = 1000, out: int = 10,
         grad: int = 8) -> PartProfile:
    return PartProfile(f, i, w, act, params, out, grad)


def test_json_round_trip_and_loading_needs_no_torch(tmp_path: Path) -> None:
    profile = Profile((part(), part(f=3.0, out=12)), 4, {"task": "x"})
    path = tmp_path / "p.json"
    save_profile(profile, path)
    assert load_profile(path) == profile and load_profile(path).meta == {"task": "x"}
    code = ("import sys; sys.modules['torch'] = None\n"  # any torch import would now fail
            "from duplexpipe.planner.profile import load_profile\n"
            f"print(load_profile({str(path)!r}).num_parts)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "2"


@pytest.mark.parametrize(("edit", "needle"), [
    (lambda d: d.pop("parts"), "missing field 'parts'"),
    (lambda d: d["parts"][1].pop("backward_weight_s"), "parts[1]: missing field 'backward_weight_s'"),
    (lambda d: d["parts"][0].update(activation_bytes=-3), "'activation_bytes' must be a finite number >= 0"),
    (lambda d: d["parts"][0].update(param_bytes=1.5), "'param_bytes' must be a whole number of bytes"),
    (lambda d: d["parts"][0].update(forward_s="fast"), "'forward_s' must be a finite number >= 0, got 'fast'"),
    (lambda d: d.update(format="other"), "not a duplexpipe profile"),
    (lambda d: d.update(version=9), "unsupported profile version 9"),
    (lambda d: d.update(microbatch_size=0), "'microbatch_size' must be an integer >= 1, got 0"),
])
def test_bad_profiles_name_the_field(tmp_path: Path, edit, needle: str) -> None:  # type: ignore[no-untyped-def]
    data = Profile((part(), part()), 2).to_dict()
    edit(data)
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(data), encoding="utf-8")
    with pytest.raises(ProfileError) as info:
        load_profile(path)
    assert needle in str(info.value) and str(path) in str(info.value)


def test_unreadable_and_invalid_files(tmp_path: Path) -> None:
    with pytest.raises(ProfileError, match="cannot read profile"):
        load_profile(tmp_path / "missing.json")
    (tmp_path / "x.json").write_text("{nope", encoding="utf-8")
    with pytest.raises(ProfileError, match="is not valid JSON"):
        load_profile(tmp_path / "x.json")
    with open(tmp_path / "huge.json", "wb") as fh:
        fh.truncate(100 * 2**20)  # sparse
    with pytest.raises(ProfileError, match="is 104,857,600 bytes, over the 64 MiB limit for a profile"):
        load_profile(tmp_path / "huge.json")


def test_scaling_to_another_microbatch_keeps_parameters() -> None:
    profile = Profile((part(f=2.0, act=100, out=10, grad=8),), 4)
    half = profile.at_microbatch(2).parts[0]
    assert (half.forward_s, half.backward_input_s, half.backward_weight_s) == (1.0, 1.0, 0.5)
    assert (half.activation_bytes, half.output_bytes, half.output_grad_bytes, half.param_bytes) == (50, 5, 4, 1000)
    assert half.backward_s == 1.5
    with pytest.raises(ProfileError, match="microbatch size must be > 0"):
        profile.at_microbatch(0)


def test_grouping_sums_balanced_runs_and_keeps_the_last_message() -> None:
    parts = (part(f=1, i=1, w=1), part(f=1, i=1, w=1), part(f=4, i=4, w=4, out=99), part(f=1, i=1, w=1, out=7))
    profile = Profile(parts, 1)
    groups = profile.grouped(2)  # F+B costs 3, 3, 12, 3: the best cut is 3+3 | 12+3 (largest 15)
    assert [g.forward_s for g in groups] == [2.0, 5.0]
    assert [g.activation_bytes for g in groups] == [200, 200] and groups[1].output_bytes == 7
    assert profile.grouped(4) == parts
    with pytest.raises(ProfileError, match="profile has 4 parts; 5 model parts need a profile of at least 5"):
        profile.grouped(5)


def test_check_parts_and_constructor_checks() -> None:
    profile = Profile((part(), part()), 2)
    profile.check_parts(2)
    with pytest.raises(ProfileError, match="the profile has 2 parts, but the model has 3"):
        profile.check_parts(3)
    with pytest.raises(ProfileError, match="at least one part"):
        Profile((), 2)
    with pytest.raises(ProfileError, match="microbatch_size must be an integer >= 1"):
        Profile((part(),), 0)


def affine(f: float = 1.0, fixed: float = 0.25, **kw: object) -> PartProfile:
    return replace(part(f=f, **kw), forward_fixed_s=fixed, backward_input_fixed_s=fixed / 2,  # type: ignore[arg-type]
                   backward_weight_fixed_s=0.0)


def test_affine_parts_and_overhead_round_trip_and_old_profiles_load_as_before(tmp_path: Path) -> None:
    profile = Profile((affine(), affine(f=3.0)), 4, {}, RuntimeOverhead(1e-4, 2e-4, 3e-3, "calibrated"))
    save_profile(profile, tmp_path / "new.json")
    again = load_profile(tmp_path / "new.json")
    assert again == profile and again.overhead == profile.overhead and again.parts[0].fixed == (0.25, 0.125, 0.0)
    old = Profile((part(), part()), 4).to_dict()  # what version-1 files without the new fields hold
    assert "forward_fixed_s" not in old["parts"][0] and "overhead" not in old
    loaded = Profile.from_dict(old)
    assert loaded.overhead is None and all(p.fixed is None for p in loaded.parts)
    assert loaded.at_microbatch(2).parts[0].forward_s == 0.5  # linear, as before


def test_compute_scale_round_trips_and_older_overheads_load_with_one(tmp_path: Path) -> None:
    profile = Profile((affine(),), 4, {}, RuntimeOverhead(1e-4, 2e-4, 3e-3, "in pipeline", compute_scale=1.4,
                                                          wall_scale=1.3))
    save_profile(profile, tmp_path / "scaled.json")
    assert load_profile(tmp_path / "scaled.json").overhead == profile.overhead
    data = profile.to_dict()
    del data["overhead"]["compute_scale"], data["overhead"]["wall_scale"]  # a profile written before the fields
    older = Profile.from_dict(data).overhead
    assert older is not None and older.compute_scale == 1.0 and older.wall_scale == 1.0 and older.action_s == 1e-4


def test_affine_scaling_grouping_and_basic() -> None:
    p = affine(f=1.0, fixed=0.25)  # F = 0.25 + 0.75 x (rows / 4)
    assert p.scaled(0.5).forward_s == pytest.approx(0.625) and p.scaled(0.5).fixed == p.fixed
    assert p.scaled(2.0).backward_input_s == pytest.approx(0.125 + 1.875 * 2)
    assert p.scaled(2.0).backward_weight_s == pytest.approx(2.0)  # no fixed part: linear
    groups = Profile((affine(), affine(), part(f=10.0)), 1).grouped(2)  # runs of 2 and 1
    fixed = [g.fixed for g in groups]
    assert fixed[0] is not None and fixed[0][0] == pytest.approx(0.5) and fixed[1] is None  # a part without a fit
    profile = Profile((affine(),), 4, {}, RuntimeOverhead(1.0, 1.0, 1.0))
    assert profile.basic().overhead is None and profile.basic().parts[0].fixed is None


@pytest.mark.parametrize(("edit", "needle"), [
    (lambda d: d["parts"][0].update(forward_fixed_s=5.0), "'forward_fixed_s' (5.0) exceeds 'forward_s'"),
    (lambda d: d["parts"][0].update(backward_weight_fixed_s=-1), "'backward_weight_fixed_s' must be a finite"),
    (lambda d: d.update(overhead=[1, 2]), "overhead: expected an object, got list"),
    (lambda d: d.update(overhead={"action_s": 1e-4, "message_s": 0.0}), "overhead: missing field 'step_s'"),
    (lambda d: d.update(overhead={"action_s": 0, "message_s": 0, "step_s": 0, "compute_scale": 0}),
     "overhead: runtime overhead compute_scale must be a finite number > 0, got 0"),
    (lambda d: d.update(overhead={"action_s": -1, "message_s": 0, "step_s": 0}),
     "overhead: runtime overhead action_s must be a finite number >= 0, got -1"),
])
def test_bad_new_fields_name_the_field(edit, needle: str) -> None:  # type: ignore[no-untyped-def]
    data = Profile((affine(), affine()), 2).to_dict()
    edit(data)
    with pytest.raises(ProfileError) as info:
        Profile.from_dict(data, "p.json")
    assert needle in str(info.value) and "p.json" in str(info.value)


def test_fused_backward_round_trips_scales_and_groups() -> None:
    p = replace(part(f=1.0, i=2.0, w=1.0), backward_fused_s=2.5, backward_fused_fixed_s=0.5)
    assert p.full_backward_s == 2.5 and part().full_backward_s == 3.0
    assert p.scaled(2.0).backward_fused_s == pytest.approx(0.5 + 2.0 * 2)
    assert Profile.from_dict(Profile((p,), 1).to_dict()).parts[0] == p
    groups = Profile((p, p, part(f=30.0)), 1).grouped(2)
    assert groups[0].backward_fused_s == 5.0 and groups[1].backward_fused_s is None
