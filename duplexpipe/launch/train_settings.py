"""`duplexpipe train`'s settings, generated from the dataclasses: every field of TrainConfig and of its sections (its
PipelineConfig among them) is a command-line flag and a config-file key, typed by the field's annotation and explained
by its docstring (`fielddoc`), so help, config files and docs cannot drift from the code."""

from __future__ import annotations

import argparse
import ast
import dataclasses
import sys
import types
import typing
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

from duplexpipe.fielddoc import field_docs
from duplexpipe.launch.train_config import CHOICES, TrainConfig

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on Python 3.10 only
    import tomli as tomllib

HIDDEN: Mapping[str, str] = MappingProxyType({})
"""Settings (by key) that are deliberately no flag, each with the reason. A field left out of this table is a flag (and
a config-file key) as soon as it exists, when its type is one the command line can write (a bool, int, float or str, a
union with None or of those, a Literal, a dict of options, or a dataclass of such fields: a section, or an options
table, which becomes a group of flags); a field of any other type must be listed here (a test walks the fields)."""
FLAG_NAMES: Mapping[str, tuple[str, ...]] = MappingProxyType({
    "task_options": ("--task-option",), "optimizer.name": ("--optimizer",),
    "pipeline.num_microbatches": ("--microbatches",), "pipeline.schedule_options": ("--opt",),
    "pipeline.precision.dtype": ("--precision",), "pipeline.safety.timeout_s": ("--timeout",)})
"""Flags whose name is not the field's name with dashes (a dict field's flag is singular: one KEY=VALUE each)."""
OFF_AT_ZERO = ("pipeline.grad_clip_norm",)
"""Settings whose 0 in a config file or on the command line means None (TOML has no None): off."""
SECTION_MODULES = ("duplexpipe.launch.train_config", "duplexpipe.config.pipeline", "duplexpipe.config.sections")
"""A dataclass field of a class defined here is a section: its fields' flags are named by the field alone (--lr,
--zero-stage); any other dataclass is an options table, whose flags carry its name (--zero-hpz-ranks)."""
MAX_CONFIG_FILE_BYTES = 2**20
"""Largest TOML config file read (1 MiB)."""


@dataclass(frozen=True)
class Setting:
    """One setting of `duplexpipe train`: a flag, a config-file key and the field it sets."""

    key: str
    """The field's path from TrainConfig, "section.field" ("steps", "optimizer.lr", "pipeline.data_parallel.zero_stage",
    "pipeline.data_parallel.zero.hpz_ranks"): its table and key in the config file."""
    section: str
    """The section holding it ("" for TrainConfig's own fields, "pipeline.data_parallel", ...): its group in --help."""
    hint: Any
    """The field's type."""
    doc: str
    """The field's docstring."""
    default: Any
    """The field's default."""
    flags: tuple[str, ...]
    """The command-line flags (the first is shown in help and errors)."""

    @property
    def kind(self) -> str:
        """How the command line writes it: "bool", "dict" (repeatable KEY=VALUE), "switch" (a bool or a dict: the
        flag alone, or with KEY=VALUE options) or "text" (one value)."""
        members = _members(self.hint)
        if bool in members:
            return "switch" if dict in members else "bool"
        return "dict" if dict in members else "text"

    @property
    def choices(self) -> tuple[Any, ...] | None:
        """The values a Literal type or CHOICES allow (None: any of the type)."""
        literal = [a for m in _union(self.hint) if typing.get_origin(m) is typing.Literal for a in typing.get_args(m)]
        if literal:
            return tuple(literal)
        return CHOICES.get(self.key)

    def help(self) -> str:
        """The docstring with the default (on/off for a flag pair)."""
        if self.kind in ("bool", "switch"):
            shown = "on" if self.default is True else "off" if self.default in (False, None) else repr(self.default)
            if self.kind == "switch":
                return f"{self.doc} Options: {self.flags[0]} KEY=VALUE ... (default {shown})"
        elif self.kind == "dict":
            return f"{self.doc} Repeatable: {self.flags[0]} KEY=VALUE."
        else:
            shown = "none" if self.default is None else str(self.default)
        return f"{self.doc} (default {shown})"

    def convert(self, text: str) -> Any:
        """A flag's text as the field's type: the first of its types (int, float, str) that reads it; "none" is None
        where the field takes None; a choice must be one of the choices."""
        if self.choices is not None and text not in [str(c) for c in self.choices]:
            raise argparse.ArgumentTypeError(f"{self.flags[0]} must be one of {', '.join(map(str, self.choices))}, "
                                             f"got {text!r}")
        if text.strip().lower() == "none" and type(None) in _union(self.hint):
            return None
        for kind in (int, float, str):
            if kind in _members(self.hint) or (kind is str and _members(self.hint) - {int, float}):
                try:
                    return kind(text)
                except ValueError:
                    continue
        expected = " or ".join(k.__name__ for k in (int, float) if k in _members(self.hint))
        raise argparse.ArgumentTypeError(f"{self.flags[0]} must be {expected}, got {text!r}")


def _union(hint: Any) -> tuple[Any, ...]:
    return typing.get_args(hint) if typing.get_origin(hint) in (typing.Union, types.UnionType) else (hint,)


def _members(hint: Any) -> set[Any]:
    """The plain types a field takes (Literal values' types, generic aliases by their origin, Any as str)."""
    out: set[Any] = set()
    for member in _union(hint):
        if typing.get_origin(member) is typing.Literal:
            out.update(type(a) for a in typing.get_args(member))
        elif member is Any:
            out.add(str)
        else:
            out.add(typing.get_origin(member) or member)
    return out - {type(None)}


def _nested(hint: Any) -> type | None:
    """The dataclass a field holds (a section, or an options table whose flags become a group), or None."""
    members = _members(hint)
    only = next(iter(members)) if len(members) == 1 else None
    return only if isinstance(only, type) and dataclasses.is_dataclass(only) else None


def is_section(cls: type) -> bool:
    """True for a section (a dataclass of SECTION_MODULES), False for an options table."""
    return cls.__module__ in SECTION_MODULES


def writable(hint: Any) -> bool:
    """True when the command line can write a value of this type (see HIDDEN)."""
    return bool(_members(hint) & {bool, int, float, str, dict}) or _nested(hint) is not None


def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _fields(cls: type, instance: Any, prefix: str = "", flag_prefix: str = "", section: str = "") -> list[Setting]:
    """The settings of `cls`'s fields under `prefix` (a section's or an options table's fields, recursively)."""
    hints, docs = _hints(cls), field_docs(cls)
    out = []
    for f in dataclasses.fields(cls):
        key, hint, value = f"{prefix}{f.name}", hints[f.name], getattr(instance, f.name)
        nested = _nested(hint)
        if key in HIDDEN:
            continue
        if nested is not None and is_section(nested):
            out.extend(_fields(nested, value, f"{key}.", flag_prefix, key))
        elif nested is not None:
            out.extend(_fields(nested, value, f"{key}.", f"{flag_prefix}{f.name}-", section))
        elif writable(hint):
            flags = FLAG_NAMES.get(key, (f"--{flag_prefix}{f.name}".replace("_", "-"),))
            out.append(Setting(key, section, hint, docs.get(f.name, f.name.replace("_", " ")), value, flags))
    return out


def settings() -> list[Setting]:
    """Every setting: TrainConfig's fields and, section by section, those of its sections (the pipeline's among
    them; torch-free: the config dataclasses are `duplexpipe.config`'s)."""
    return _fields(TrainConfig, TrainConfig())


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """One flag per setting, in one group per section (the run's own fields, optimizer, metrics, checkpoint, the
    pipeline and its sections), each flag's help its field's docstring. Flags left out keep the config file's
    value, else the default."""
    groups: dict[str, Any] = {}
    for s in settings():
        if s.section not in groups:
            title = f"[{s.section}] (TrainConfig.{s.section})" if s.section else "the run (TrainConfig)"
            groups[s.section] = parser.add_argument_group(title)
        group = groups[s.section]
        common: dict[str, Any] = {"dest": s.key, "default": argparse.SUPPRESS,
                                  "help": s.help().replace("%", "%%")}  # argparse formats help with %
        if s.kind == "bool":
            group.add_argument(*s.flags, action=argparse.BooleanOptionalAction, **common)
        elif s.kind == "switch":
            group.add_argument(*s.flags, nargs="*", metavar="KEY=VALUE", **common)
            group.add_argument(*(f"--no-{f[2:]}" for f in s.flags), dest=s.key, action="store_const", const=False,
                               default=argparse.SUPPRESS, help=argparse.SUPPRESS)
        elif s.kind == "dict":
            group.add_argument(*s.flags, action="append", metavar="KEY=VALUE", **common)
        else:
            metavar = "{" + ",".join(map(str, s.choices)) + "}" if s.choices else s.key.split(".")[-1].upper()
            group.add_argument(*s.flags, type=s.convert, metavar=metavar, **common)


def parse_key_values(items: Sequence[str]) -> dict[str, Any]:
    """["n_layer=8", "lr=1e-3", "name=abc"] -> {"n_layer": 8, "lr": 0.001, "name": "abc"} (Python literals, else
    the text)."""
    options: dict[str, Any] = {}
    for item in items:
        key, sep, text = item.partition("=")
        if not sep or not key.isidentifier():
            raise ValueError(f"option {item!r} must look like KEY=VALUE")
        try:
            options[key] = ast.literal_eval(text)
        except (ValueError, SyntaxError):
            options[key] = text.lower() == "true" if text.lower() in ("true", "false") else text
    return options


def values_from_args(args: argparse.Namespace) -> dict[str, Any]:
    """The settings given on the command line, by key (repeated KEY=VALUE flags as one dict; a switch alone True,
    with options their dict)."""
    given = vars(args)
    out = {}
    for s in settings():
        if s.key not in given:
            continue
        value = given[s.key]
        if s.kind == "dict":
            value = parse_key_values(value)
        elif s.kind == "switch" and isinstance(value, list):
            value = _switch_value(s, value)
        out[s.key] = value
    return out


def _switch_value(setting: Setting, items: list[str]) -> Any:
    """A switch's words: alone True; KEY=VALUE options a dict; else, where the field takes them, one word as text
    ("selective") or whole numbers as a list ("0 2")."""
    members = _members(setting.hint)
    if not items:
        return True
    if any("=" in item for item in items) or not (members & {str, Collection}):
        return parse_key_values(items)
    if Collection in members and all(item.isdigit() for item in items):
        return [int(item) for item in items]
    if str in members and len(items) == 1:
        return items[0]
    raise ValueError(f"{setting.flags[0]} takes KEY=VALUE options, one word or stage numbers; got {' '.join(items)}")


def _check_type(key: str, value: Any, hint: Any) -> Any:
    """`value` as the field's type (an int for a float field becomes a float); ValueError otherwise."""
    allowed = tuple(_members(hint)) + ((type(None),) if type(None) in _union(hint) else ())
    if float in allowed and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if (isinstance(value, bool) and bool not in allowed) or not isinstance(value, allowed):
        names = " or ".join("none" if a is type(None) else a.__name__ for a in allowed)
        raise ValueError(f"{key} must be {names}, got {value!r}")
    return value


def check_keys(values: Mapping[str, Any], source: str) -> dict[str, Any]:
    """Values by setting key, type-checked: `values` holds keys (dashes allowed for underscores) and tables (a
    section or an options table as a dict, or its fields as "table.field" keys). ValueError naming unknown keys and
    the valid ones, or a value of the wrong type."""
    table = {s.key: s for s in settings()}
    tables = {k.rsplit(".", 1)[0] for k in table if "." in k}
    tables |= {t.rsplit(".", i)[0] for t in tables for i in range(t.count(".") + 1)}
    out: dict[str, Any] = {}
    unknown: list[str] = []

    def walk(items: Mapping[str, Any], prefix: str) -> None:
        for raw, value in items.items():
            key = prefix + raw.replace("-", "_")
            if key in table:
                out[key] = _check_type(key, value, table[key].hint)
            elif key in tables and isinstance(value, Mapping):
                walk(value, f"{key}.")
            else:
                unknown.append(key)
    walk(values, "")
    if unknown:
        valid = ", ".join(k for k in table if "." not in k)
        raise ValueError(f"{source}: unknown keys {unknown}; valid keys: {valid}, and the tables "
                         f"{', '.join(sorted(tables))}")
    return out


def load_config_file(path: str) -> dict[str, Any]:
    """The settings of a TOML config file, by key: TrainConfig's fields at the top, a section's in its table
    ([optimizer], [metrics], [checkpoint], [pipeline], [pipeline.data_parallel], ...), options as tables
    ([task_options], [pipeline.schedule_options], [pipeline.data_parallel.zero]); ValueError for a file over
    MAX_CONFIG_FILE_BYTES, unreadable or not TOML, before anything in it is used."""
    from duplexpipe.files import read_capped_text

    try:
        data = tomllib.loads(read_capped_text(path, MAX_CONFIG_FILE_BYTES, "config file"))
    except OSError as exc:
        raise ValueError(f"config file {path}: cannot read it ({exc.strerror})") from None
    except tomllib.TOMLDecodeError as exc:
        raise ValueError(f"config file {path}: not valid TOML ({exc})") from None
    except RecursionError:
        raise ValueError(f"config file {path}: nested too deeply to be a configuration") from None
    return check_keys(data, f"config file {path}")


def merge_config(file_values: Mapping[str, Any], flag_values: Mapping[str, Any]) -> TrainConfig:
    """TrainConfig from its defaults, overridden by the config file, overridden by command-line flags (a dict
    setting merged key by key); each section is built with its own checks."""
    files, flags = check_keys(file_values, "config file"), check_keys(flag_values, "command line")
    merged = {**files, **flags}
    for key in set(files) & set(flags):
        if isinstance(files[key], dict) and isinstance(flags[key], dict):
            merged[key] = {**files[key], **flags[key]}
    for key in OFF_AT_ZERO:
        if merged.get(key) == 0:
            merged[key] = None
    tree: dict[str, Any] = {}
    for key, value in merged.items():
        *path, name = key.split(".")
        node = tree
        for part in path:
            node = node.setdefault(part, {})
        node[name] = value
    return _replaced(TrainConfig(), tree)  # type: ignore[no-any-return]


def _replaced(instance: Any, values: Mapping[str, Any]) -> Any:
    """`instance` (a dataclass) with `values` set, a dict for a dataclass field replacing that field's fields."""
    changes = {}
    for name, value in values.items():
        current = getattr(instance, name)
        nested = dataclasses.is_dataclass(current) and isinstance(value, Mapping)
        changes[name] = _replaced(current, value) if nested else value
    try:
        return dataclasses.replace(instance, **changes)
    except TypeError as exc:
        raise ValueError(f"{type(instance).__name__}: {exc}") from None


__all__ = ["HIDDEN", "Setting", "add_arguments", "check_keys", "load_config_file", "merge_config",
           "parse_key_values", "settings", "values_from_args", "writable"]
