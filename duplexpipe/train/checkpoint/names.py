"""This rank's checkpoint dicts under the model's global names (independent of schedule, partition, DP and ZeRO), and
the names a checkpoint must hold for a run to resume from it."""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from duplexpipe.model.stages import inner_module
from duplexpipe.model.state_names import names_whole_model, part_state_keys
from duplexpipe.schedules.ir import Schedule
from duplexpipe.train.part_chain import PartChain

FORMAT = 2
"""The checkpoint format `save_checkpoint` writes (1, stage-keyed `model.stage<s>.<name>`, is no longer read)."""
TRAINER_ENTRIES = ("trainer.format", "trainer.layout", "trainer.calls", "trainer.optimizer_steps",
                   "trainer.fresh_optimizer", "trainer.scaler.scale", "trainer.scaler.good_steps",
                   "trainer.scaler.skipped_steps")
"""The trainer entries every checkpoint a run resumes from holds (`pipeline.trainer_state`, flattened)."""
_STAGE_KEY = re.compile(r"^model\.stage\d+\.")
OPTIM_SECTIONS = ("state.", "param_groups.")
"""The prefixes of torch's flattened optimizer state dict: `state.<param>.<name>`, `param_groups.<param>.<key>`."""


def stage_state_keys(module: nn.Module, part: int, merged: Sequence[int] | None = None) -> dict[str, str]:
    """{local state key: global key} of one stage module running model part `part`.

    `merged` (schedule="auto": how many given parts each model part holds) numbers the given parts inside a
    PartChain, so each keeps the names it has unmerged.
    """
    module = inner_module(module)
    if not isinstance(module, PartChain):
        return part_state_keys(module, part)
    first = sum(merged[:part]) if merged is not None else part
    out: dict[str, str] = {}
    for offset, inner in enumerate(module.parts):
        prefix = f"parts.{offset}."
        index = first + offset if merged is not None or names_whole_model(inner) else part
        keys = part_state_keys(inner, index)
        out.update({prefix + local: name for local, name in keys.items()})
    return out


@dataclass
class StateKeys:
    """How this rank's checkpoint dicts (keys `stage<s>.<local>`, as `checkpoint_dicts` makes them) map to global
    names. Stages holding a second copy of a weight group (DualPipe) are left out when saving; when loading they
    read the same names as the first copy."""

    names: dict[str, str]
    """`stage<s>.<local>` -> global name, for every state entry of this rank's stages."""
    later_copies: frozenset[int] = frozenset()
    """This rank's stages that hold a second (or later) copy of their weight group."""
    aliases: dict[str, list[str]] = field(default_factory=dict)
    """Filled by `to_global(loading=True)`: global key -> the further local keys that read it."""

    @classmethod
    def of(cls, modules: Mapping[int, nn.Module], schedule: Schedule, merged: Sequence[int] | None = None
           ) -> StateKeys:
        """The map for this rank's stage modules under `schedule`."""
        names: dict[str, str] = {}
        for stage, module in sorted(modules.items()):
            part = schedule.stages[stage].group
            for local, name in stage_state_keys(module, part, merged).items():
                names[f"stage{stage}.{local}"] = name
        later = frozenset(s for s in modules if schedule.copy_of_stage(s) != 0)
        return cls(names, later)

    def _stage(self, fqn: str) -> int:
        return int(fqn.split(".", 1)[0][len("stage"):])

    def model_key(self, key: str) -> str:
        """The global name of a model entry `stage<s>.<local>`."""
        try:
            return self.names[key]
        except KeyError:
            raise ValueError(f"no global name for state entry {key!r}") from None

    def optim_key(self, key: str) -> tuple[str, str]:
        """(global key, the parameter's `stage<s>.<local>` name) of a flattened optimizer entry."""
        for section in OPTIM_SECTIONS:
            if key.startswith(section):
                fqn, _, leaf = key[len(section):].rpartition(".")
                return f"{section}{self.model_key(fqn)}.{leaf}", fqn
        raise ValueError(f"unexpected optimizer state entry {key!r} (expected state.* or param_groups.*)")

    def to_global(self, model: Mapping[str, Any], optim: Mapping[str, Any], loading: bool
                  ) -> tuple[dict[str, Any], dict[str, Any]]:
        """The dicts under global names. Saving: later copies left out. Loading: one entry per global name; the
        other local entries of that name are recorded in `aliases` and filled by `to_local`."""
        self.aliases = {}
        out_model = self._rename(model, lambda k: (self.model_key(k), k), loading)
        out_optim = self._rename(optim, self.optim_key, loading)
        return out_model, out_optim

    def _rename(self, entries: Mapping[str, Any], rename: Any, loading: bool) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for key, value in entries.items():
            name, fqn = rename(key)
            if not loading and self._stage(fqn) in self.later_copies:
                continue
            if name in out:
                if not loading:
                    raise ValueError(f"state entries of two stages on this rank both map to {name!r}")
                self.aliases.setdefault(name, []).append(key)
                continue
            out[name] = value
        return out

    def to_local(self, model: dict[str, Any], optim: dict[str, Any], loaded_model: Mapping[str, Any],
                 loaded_optim: Mapping[str, Any]) -> None:
        """After loading `to_global`'s dicts: put every loaded value back under its local keys (in place)."""
        for entries, loaded, rename in ((model, loaded_model, lambda k: (self.model_key(k), k)),
                                        (optim, loaded_optim, self.optim_key)):
            for key in list(entries):
                name, _ = rename(key)
                value = loaded[name]
                target = entries[key]
                if isinstance(target, torch.Tensor) and isinstance(value, torch.Tensor) and target is not value:
                    with torch.no_grad():
                        target.copy_(value)
                elif not isinstance(target, torch.Tensor):
                    entries[key] = value


def format_problems(stored: Mapping[str, Any]) -> list[str]:
    """Why a run cannot resume from a checkpoint holding entries `stored` (its metadata's names), whatever the model:
    the stage-keyed format 1, or trainer entries missing; [] when none. Resume and `checkpoint verify` both check."""
    if "trainer.format" not in stored and any(_STAGE_KEY.match(k) for k in stored):
        return ["it has the stage-keyed format 1 of earlier duplexpipe versions, which this version no longer reads; "
                "to convert it, load it with duplexpipe 0.1 into a Pipeline built like the saving one and save it "
                "again with pipe.save() (see CHANGELOG.md)"]
    missing = [name for name in TRAINER_ENTRIES if name not in stored]
    if missing:
        return [f"it lacks the trainer entries {', '.join(missing)}: not a checkpoint duplexpipe training wrote, a run "
                "cannot resume from it"]
    return []
