"""`duplexpipe train`'s settings, generated from the dataclasses: every TrainConfig field and every PipelineConfig
field a run passes on is a command-line flag and a config-file key, typed by the field's annotation and explained by
its docstring (`fielddoc`), so help, config files and docs cannot drift from the code."""

from __future__ import annotations

import argparse
import ast
import dataclasses
import sys
import types
import typing
from collections.abc import Mapping, Sequence
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
"""PipelineConfig fields that are deliberately no flag, each with the reason. A field left out of this table is a flag
(and a config-file key) as soon as it exists, when its type is one the command line can write (a bool, int, float or
str, a union with None or of those, a Literal, a dict of options, or a dataclass of such fields, which becomes a group
of flags); a field of any other type must be listed here (a test walks the fields)."""
MIRRORED: Mapping[str, str] = MappingProxyType({"num_microbatches": "microbatches"})
"""PipelineConfig fields that a TrainConfig field of another name carries (a TrainConfig field of the field's own name
carries it too: `schedule`, `precision`, ...); `pipeline_config` passes them on."""
FLAG_NAMES: Mapping[str, tuple[str, ...]] = MappingProxyType({
    "timeout_s": ("--timeout",), "task_options": ("--task-option",), "schedule_options": ("--opt",)})
"""Flags whose name is not the field's name with dashes (a dict field's flag is singular: one KEY=VALUE each)."""
INTERNAL = ("pipeline",)
"""TrainConfig fields that are no setting of their own (`pipeline` holds the generated PipelineConfig settings)."""
MAX_CONFIG_FILE_BYTES = 2**20
"""Largest TOML config file read (1 MiB)."""
RUN, PIPELINE = "run", "pipeline"


@dataclass(frozen=True)
class Setting:
    """One setting of `duplexpipe train`: a flag, a config-file key and the field it sets."""

    key: str
    """The config-file key: the field's name, or "table.field" for a field of a nested options dataclass."""
    owner: str
    """RUN (a TrainConfig field) or PIPELINE (a PipelineConfig field, kept in TrainConfig.pipeline)."""
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
        """How the command line writes it: "bool", "dict" (repeatable KEY=VALUE) or "text" (one value)."""
        members = _members(self.hint)
        if bool in members:
            return "bool"
        return "dict" if dict in members else "text"

    @property
    def choices(self) -> tuple[Any, ...] | None:
        """The values a Literal type or TrainConfig's CHOICES allow (None: any of the type)."""
        literal = [a for m in _union(self.hint) if typing.get_origin(m) is typing.Literal for a in typing.get_args(m)]
        if literal:
            return tuple(literal)
        return CHOICES.get(self.key) if self.owner == RUN else None

    def help(self) -> str:
        """The docstring with the default (on/off for a flag pair)."""
        if self.kind == "bool":
            shown = "on" if self.default is True else "off" if self.default in (False, None) else repr(self.default)
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
    """The options dataclass a field holds (its flags become a group), or None."""
    members = _members(hint)
    only = next(iter(members)) if len(members) == 1 else None
    return only if isinstance(only, type) and dataclasses.is_dataclass(only) else None


def writable(hint: Any) -> bool:
    """True when the command line can write a value of this type (see HIDDEN)."""
    return bool(_members(hint) & {bool, int, float, str, dict}) or _nested(hint) is not None


def _flags(key: str) -> tuple[str, ...]:
    return FLAG_NAMES.get(key, (f"--{key.replace('.', '-').replace('_', '-')}",))


def _fields(cls: type, owner: str, prefix: str = "", default: Any = None) -> list[Setting]:
    """The settings of `cls`'s fields (a nested options dataclass's fields as "field.sub")."""
    hints, docs = typing.get_type_hints(cls), field_docs(cls)
    instance = default if default is not None else cls()
    out = []
    for f in dataclasses.fields(cls):
        key, hint, value = f"{prefix}{f.name}", hints[f.name], getattr(instance, f.name)
        nested = _nested(hint) if not prefix else None
        if nested is not None:
            out.extend(_fields(nested, owner, f"{key}.", value))
        elif writable(hint):
            out.append(Setting(key, owner, hint, docs.get(f.name, f.name.replace("_", " ")), value, _flags(key)))
    return out


def carried(name: str) -> str | None:
    """The TrainConfig field that carries PipelineConfig field `name` (MIRRORED, or one of the same name), or None."""
    own = {f.name for f in dataclasses.fields(TrainConfig)} - set(INTERNAL)
    return MIRRORED.get(name) or (name if name in own else None)


def settings() -> list[Setting]:
    """Every setting: TrainConfig's fields, then the PipelineConfig fields no TrainConfig field carries and HIDDEN
    does not hide (imports the training stack: PipelineConfig's types are torch's)."""
    from duplexpipe.train.pipeline_config import PipelineConfig

    run = [s for s in _fields(TrainConfig, RUN) if s.key not in INTERNAL]
    hints = typing.get_type_hints(PipelineConfig)
    wanted = {f.name for f in dataclasses.fields(PipelineConfig)
              if carried(f.name) is None and f.name not in HIDDEN and writable(hints[f.name])}
    return run + [s for s in _fields(PipelineConfig, PIPELINE) if s.key.split(".")[0] in wanted]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """One flag per setting, in two groups (the run; the pipeline's settings, PipelineConfig), each flag's help its
    field's docstring. Flags left out keep the config file's value, else the default."""
    groups = {RUN: parser.add_argument_group("the run (TrainConfig)"),
              PIPELINE: parser.add_argument_group("the pipeline (PipelineConfig; a table of options, such as zero, is "
                                                  "a [zero] table in the config file)")}
    for s in settings():
        common: dict[str, Any] = {"dest": s.key, "default": argparse.SUPPRESS,
                                  "help": s.help().replace("%", "%%")}  # argparse formats help with %
        if s.kind == "bool":
            groups[s.owner].add_argument(*s.flags, action=argparse.BooleanOptionalAction, **common)
        elif s.kind == "dict":
            groups[s.owner].add_argument(*s.flags, action="append", metavar="KEY=VALUE", **common)
        else:
            metavar = "{" + ",".join(map(str, s.choices)) + "}" if s.choices else s.key.split(".")[-1].upper()
            groups[s.owner].add_argument(*s.flags, type=s.convert, metavar=metavar, **common)


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
    """The settings given on the command line, by key (repeated KEY=VALUE flags as one dict)."""
    given = vars(args)
    out = {}
    for s in settings():
        if s.key in given:
            out[s.key] = parse_key_values(given[s.key]) if s.kind == "dict" else given[s.key]
    return out


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
    """Values by setting key (dashes allowed for underscores; a nested options table as a dict or as "table.field"
    keys), type-checked. ValueError naming unknown keys and the valid ones, or a value of the wrong type."""
    table = {s.key: s for s in settings()}
    tables = {k.split(".")[0] for k in table if "." in k}
    out: dict[str, Any] = {}
    unknown = []
    for raw, value in values.items():
        key = raw.replace("-", "_")
        if key in tables and isinstance(value, dict):
            out.update(check_keys({f"{key}.{k}": v for k, v in value.items()}, source))
        elif key in table:
            out[key] = _check_type(key, value, table[key].hint)
        else:
            unknown.append(raw)
    if unknown:
        valid = ", ".join(k for k in table if "." not in k)
        raise ValueError(f"{source}: unknown keys {unknown}; valid keys: {valid}, and the tables "
                         f"{', '.join(sorted(tables))}")
    return out


def load_config_file(path: str) -> dict[str, Any]:
    """The settings of a TOML config file (keys named like the flags with underscores; [task_options] and
    [schedule_options] tables; nested options as tables, e.g. [zero]); ValueError for a file over
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
    setting merged key by key). PipelineConfig settings go to TrainConfig.pipeline ({"zero": {...}} for a table)."""
    files, flags = check_keys(file_values, "config file"), check_keys(flag_values, "command line")
    merged = {**files, **flags}
    for key in set(files) & set(flags):
        if isinstance(files[key], dict) and isinstance(flags[key], dict):
            merged[key] = {**files[key], **flags[key]}
    owners = {s.key: s.owner for s in settings()}
    run: dict[str, Any] = {}
    pipeline: dict[str, Any] = {}
    for key, value in merged.items():
        if owners[key] == RUN:
            run[key] = value
        elif "." in key:
            table, name = key.split(".", 1)
            pipeline.setdefault(table, {})[name] = value
        else:
            pipeline[key] = value
    return TrainConfig(**run, pipeline=pipeline)


def pipeline_values(config: TrainConfig) -> dict[str, Any]:
    """PipelineConfig's keyword arguments of a run: the fields TrainConfig carries (its own "none" as None), then
    TrainConfig.pipeline (tables built into their options dataclasses)."""
    from duplexpipe.train.pipeline_config import PipelineConfig

    hints = typing.get_type_hints(PipelineConfig)
    values: dict[str, Any] = {}
    for f in dataclasses.fields(PipelineConfig):
        source = carried(f.name)
        if source is not None:
            value = getattr(config, source)
            takes_none = hints[f.name] is Any or type(None) in _union(hints[f.name])
            values[f.name] = None if value == "none" and takes_none else value
    for name, value in config.pipeline.items():
        nested = _nested(hints[name]) if name in hints else None
        values[name] = _built(nested, value) if nested is not None and isinstance(value, dict) else value
    return values


def _built(cls: type, table: Mapping[str, Any]) -> Any:
    """An options dataclass from a table; a field that takes one options dataclass may be a table too."""
    hints = typing.get_type_hints(cls)
    values = {}
    for name, value in table.items():
        inner = [m for m in _members(hints.get(name, Any)) if isinstance(m, type) and dataclasses.is_dataclass(m)]
        values[name] = _built(inner[0], value) if isinstance(value, dict) and len(inner) == 1 else value
    try:
        return cls(**values)
    except TypeError as exc:
        raise ValueError(f"{cls.__name__}: {exc}") from None


__all__ = ["HIDDEN", "MIRRORED", "Setting", "add_arguments", "carried", "check_keys", "load_config_file",
           "merge_config", "parse_key_values", "pipeline_values", "settings", "values_from_args", "writable"]
