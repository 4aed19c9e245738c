"""Settings dataclasses as the one source of a stage's YAML keys, CLI flags, Python API defaults and docs.

A stage declares its settings once, as a dataclass whose fields carry their meaning in `setting(...)` metadata.
From it come: the argparse flags (`add_settings_arguments`: type, default, choices from `Literal` types, help),
the settings built back from parsed args (`settings_from_args`: YAML section < `--set` < explicit flags), the check
of a YAML section or `--set` key (`build_settings`: an unknown key names the closest valid one), and the config
reference (`python -m eagle3_train.settings --markdown`, written to docs/CONFIG.md).
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import types
import typing
from collections.abc import Callable, Iterable
from typing import Any, Literal, TypeVar, Union

import yaml

from eagle3_train.utils.io import Eagle3InputError
from eagle3_train.utils.suggest import closest, ecosystem_target

T = TypeVar("T")
_EXPLICIT = "_explicit_settings"  # namespace attribute: dests of the flags given on the command line


def setting(default: Any = dataclasses.MISSING, help: str = "", *,  # noqa: A002 - argparse's name for it
            default_factory: Callable[[], Any] | Any = dataclasses.MISSING, flag: str | None = None,
            aliases: tuple[str, ...] = (), choices: Iterable[Any] | None = None, cli: bool = True, yaml: bool = True,
            required: bool = False, positional: bool = False, metavar: str | None = None,
            commas: bool = True, valid: str | None = None, experimental: bool = False) -> Any:
    """A dataclass field with what the CLI and the docs need to know about it.

    `flag`: the primary option (default `--field-name`); `aliases`: other accepted spellings; `cli`/`yaml`: whether
    the setting is a flag / a key of the YAML section (paths the pipeline fills in are `yaml=False`); `required`:
    a required flag (the dataclass default then only serves the Python API); `positional`: an argument, not a flag;
    `commas=False`: a repeated list flag whose values may contain commas (each use is one item); `valid`: the range
    of a number as an interval, e.g. ">= 1", "> 0", "[0, 1]", "[0, 1)" (None, where allowed, is always valid);
    `experimental`: kept for a rerun at scale, not part of the stage's core settings (the docs list it apart, the
    flag's help says so).
    """
    meta = {"help": help, "flag": flag, "aliases": tuple(aliases), "choices": tuple(choices) if choices else None,
            "cli": cli, "yaml": yaml, "required": required, "positional": positional, "metavar": metavar,
            "commas": commas, "valid": valid, "experimental": experimental}
    return dataclasses.field(default=default, default_factory=default_factory, metadata=meta)


def _in_range(value: float, valid: str) -> bool:
    if valid.startswith((">=", ">", "<=", "<")):
        op, bound = (valid[:2], valid[2:]) if valid[1] == "=" else (valid[0], valid[1:])
        b = float(bound)
        return {">=": value >= b, ">": value > b, "<=": value <= b, "<": value < b}[op]
    lo, hi = (float(x) for x in valid[1:-1].split(","))
    return (value >= lo if valid[0] == "[" else value > lo) and (value <= hi if valid[-1] == "]" else value < hi)


def check_ranges(settings: Any, where: str = "") -> None:
    """Every number of a settings dataclass is a finite number (never NaN or +-inf, which would train a draft of NaN
    without a word) within its field's `valid` range; the numbers of a list setting too."""
    for f in dataclasses.fields(settings):
        value = getattr(settings, f.name)
        values = value if isinstance(value, list | tuple) else [value]
        for v in values:
            if isinstance(v, bool) or not isinstance(v, int | float):
                continue
            valid = f.metadata.get("valid")
            if not math.isfinite(v) or (valid and not _in_range(v, valid)):
                name = f"{where}: {f.name}" if where else f"{section_name(type(settings))}.{f.name}"
                want = valid if math.isfinite(v) else f"a finite number{f' {valid}' if valid else ''}"
                raise Eagle3InputError(f"{name} must be {want}, got {v}")


# --- types -------------------------------------------------------------------------------------------------------
def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _arms(hint: Any) -> list[Any]:
    """The alternatives of a (possibly Optional / Union) type, None excluded."""
    if typing.get_origin(hint) in (Union, types.UnionType):
        return [a for a in typing.get_args(hint) if a is not type(None)]
    return [hint]


def _optional(hint: Any) -> bool:
    return typing.get_origin(hint) in (Union, types.UnionType) and type(None) in typing.get_args(hint)


def _literal_values(hint: Any) -> tuple[Any, ...] | None:
    values = [v for a in _arms(hint) if typing.get_origin(a) is Literal for v in typing.get_args(a)]
    return tuple(values) or None


def _is_list(hint: Any) -> bool:
    return all(typing.get_origin(a) in (list, tuple) for a in _arms(hint))


def _scalar(hint: Any) -> type:
    """The Python type a CLI string becomes (int, float, str or bool)."""
    for a in _arms(hint):
        if typing.get_origin(a) is Literal:
            return type(typing.get_args(a)[0])
        if typing.get_origin(a) in (list, tuple):
            return _scalar(typing.get_args(a)[0])
        if a in (bool, int, float, str):
            return a
    return str


def choices(cls: type, name: str) -> tuple[Any, ...] | None:
    """Valid values of a setting: its metadata `choices`, else the values of its `Literal` type."""
    f = next(f for f in dataclasses.fields(cls) if f.name == name)
    return f.metadata.get("choices") or _literal_values(_hints(cls)[name])


def _default(f: dataclasses.Field) -> Any:
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return None


def defaults(cls: type) -> dict[str, Any]:
    return {f.name: _default(f) for f in dataclasses.fields(cls)}


def yaml_keys(cls: type) -> list[str]:
    return [f.name for f in dataclasses.fields(cls) if f.metadata.get("yaml", True)]


def section_name(cls: type) -> str:
    return getattr(cls, "SECTION", cls.__name__)


def is_experimental(f: dataclasses.Field) -> bool:
    return bool(f.metadata.get("experimental"))


def core_fields(cls: type) -> list[dataclasses.Field]:
    """The settings of `cls` that are not experimental."""
    return [f for f in dataclasses.fields(cls) if not is_experimental(f)]


# --- checking values (YAML sections, --set, Python) ------------------------------------------------------------
def retired_note(key: str) -> str:
    return f"'{key}' was retired after it measured no gain (benchmarks/LOG.md, 'Retired training options'); delete it"


def unknown_key_error(key: str, valid: Iterable[str], where: str, cls: type | None = None) -> Eagle3InputError:
    """One line naming the key, where it was found and the valid name most likely meant (utils/suggest.py: the key
    another trainer's name stands for, else the nearest by edits), or, for a setting `cls` retired, that it was
    retired (its `RETIRED` names them). The ecosystem's names are accepted as flags only: a config and the settings
    it records keep one name for one thing."""
    if key in getattr(cls, "RETIRED", {}):
        return Eagle3InputError(f"unknown key '{key}' in {where}: {retired_note(key)}")
    valid = sorted(valid)
    suggestion = closest(key, valid)
    if suggestion is None:
        return Eagle3InputError(f"unknown key '{key}' in {where}; valid keys: {', '.join(valid)}")
    note = suggestion.note
    if ecosystem_target(key, valid):
        note += ": flags accept it, config keys are this tool's names"
    note = f" ({note})" if note else ""
    return Eagle3InputError(f"unknown key '{key}' in {where}; did you mean '{suggestion.name}'?{note}")


def _coerce(value: Any, hint: Any, where: str, choice: tuple[Any, ...] | None = None, commas: bool = True) -> Any:
    """Check `value` against the field type. Exact matches first, then strings converted (from `--set`, or YAML,
    which reads `3e-4` as a string); an int stays an int for a float field (settings hashes stay as written). A string
    for a list is split on commas unless the field says its items may hold commas (`commas=False`: one item)."""
    if value is None:
        if _optional(hint):
            return None
        raise Eagle3InputError(f"{where} must be set, got null")
    for convert in (False, True):
        for arm in _arms(hint):
            ok, v = _match(value, arm, where, convert, commas)
            if ok:
                if choice and v not in choice:
                    raise Eagle3InputError(f"{where} must be one of {list(choice)}, got {value!r}")
                return v
    literal = _literal_values(hint)
    if literal:
        raise Eagle3InputError(f"{where} must be one of {list(literal)}, got {value!r}")
    raise Eagle3InputError(f"{where} must be {_type_name(hint)}, got {value!r}")


def _match(value: Any, arm: Any, where: str, convert: bool, commas: bool = True) -> tuple[bool, Any]:
    origin = typing.get_origin(arm)
    if origin is Literal:
        allowed = typing.get_args(arm)
        if convert and isinstance(value, str):
            value = _convert_str(value, type(allowed[0]))
        return any(value == a and type(value) is type(a) for a in allowed), value
    if origin in (list, tuple):
        item = typing.get_args(arm)[0]
        if convert and isinstance(value, str):
            value = [v.strip() for v in value.split(",") if v.strip()] if commas else [value]
        if isinstance(value, (list, tuple)):
            return True, [_coerce(v, item, where) for v in value]
        return False, value
    if arm is Any:
        return True, value
    if convert and isinstance(value, str) and arm in (bool, int, float):
        value = _convert_str(value, arm)
    if arm is bool:
        return isinstance(value, bool), value
    if arm is int:
        return isinstance(value, int) and not isinstance(value, bool), value
    if arm is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool), value
    if arm is str:
        return isinstance(value, str), value
    return False, value


def _convert_str(value: str, target: type) -> Any:
    try:
        if target is bool:
            return {"true": True, "false": False, "yes": True, "no": False}[value.lower()]
        return target(value)
    except (KeyError, ValueError, TypeError):
        return value


def _type_name(hint: Any) -> str:
    if isinstance(hint, type):
        return hint.__name__
    return str(hint).replace("typing.", "")


def build_settings(cls: type[T], values: dict[str, Any], where: str, *, yaml_only: bool = False) -> T:
    """Build a settings dataclass from a mapping, naming unknown keys (with the closest valid one) and bad values.

    `where` names the source in messages (e.g. "section 'train'"); with `yaml_only`, keys the pipeline sets itself
    (`yaml=False`) are unknown too.
    """
    if not isinstance(values, dict):
        raise Eagle3InputError(f"{where} must be a mapping of key: value, got {values!r}")
    hints, fields = _hints(cls), {f.name: f for f in dataclasses.fields(cls)}
    valid = yaml_keys(cls) if yaml_only else list(fields)
    out: dict[str, Any] = {}
    for key, value in values.items():
        if key not in valid:
            raise unknown_key_error(str(key), valid, where, cls)
        out[key] = _coerce(value, hints[key], f"{where}: '{key}'", fields[key].metadata.get("choices"),
                           fields[key].metadata.get("commas", True))
    settings = cls(**out)
    check_ranges(settings, where)
    return settings


def parse_set(items: Iterable[str] | None, cls: type, prefixes: tuple[str, ...] = ()) -> dict[str, Any]:
    """`--set KEY=VALUE` or `--set SECTION.KEY=VALUE` (SECTION one of `prefixes`); values are read as YAML and
    checked against the field's type (`lr=3e-4` is the float YAML 1.1 would leave a string)."""
    out: dict[str, Any] = {}
    names, hints = [f.name for f in dataclasses.fields(cls)], _hints(cls)
    for item in items or []:
        if "=" not in item:
            raise Eagle3InputError(f"--set '{item}' must look like KEY=VALUE")
        key, raw = (s.strip() for s in item.split("=", 1))
        if "." in key:
            section, key = key.split(".", 1)
            if section not in prefixes:
                raise Eagle3InputError(f"--set '{item}': section '{section}' is not one of {list(prefixes)}")
        where = f"section '{prefixes[0]}' (--set {item})" if prefixes else f"--set {item}"
        if key not in names:
            raise unknown_key_error(key, names, where, cls)
        try:
            value = yaml.safe_load(raw) if raw else ""
        except yaml.YAMLError as e:
            raise Eagle3InputError(f"--set '{item}': the value is not valid YAML "
                                   f"({str(e).splitlines()[0]})") from None
        commas = next(f for f in dataclasses.fields(cls) if f.name == key).metadata.get("commas", True)
        out[key] = _coerce(value, hints[key], where, choices(cls, key), commas)
    return out


# --- argparse ------------------------------------------------------------------------------------------------------
def _mark(namespace: argparse.Namespace, dest: str) -> None:
    explicit = set(getattr(namespace, _EXPLICIT, set()))
    explicit.add(dest)
    setattr(namespace, _EXPLICIT, explicit)


class _Store(argparse.Action):
    def __call__(self, parser, namespace, values, option_string=None):  # noqa: ANN001 - argparse's signature
        setattr(namespace, self.dest, values)
        _mark(namespace, self.dest)


class _Append(argparse.Action):
    """Repeatable flag (values may also be comma-separated): the first use replaces the default list."""

    def __call__(self, parser, namespace, values, option_string=None):  # noqa: ANN001
        current = list(getattr(namespace, self.dest) or []) if self.dest in getattr(namespace, _EXPLICIT, ()) else []
        items = self.items(values)
        setattr(namespace, self.dest, current + items)
        _mark(namespace, self.dest)

    @staticmethod
    def items(values: Any) -> list[Any]:
        return [v.strip() for v in values.split(",") if v.strip()] if isinstance(values, str) else [values]


class _AppendWhole(_Append):
    """Repeatable flag whose every use is one item (values such as JSON may contain commas)."""

    @staticmethod
    def items(values: Any) -> list[Any]:
        return [values]


class _Bool(argparse.BooleanOptionalAction):
    def __call__(self, parser, namespace, values, option_string=None):  # noqa: ANN001
        super().__call__(parser, namespace, values, option_string)
        _mark(namespace, self.dest)


def flags(f: dataclasses.Field) -> list[str]:
    """The option strings of a setting, primary first."""
    primary = f.metadata.get("flag") or "--" + f.name.replace("_", "-")
    return [primary, *f.metadata.get("aliases", ())]


def _help(text: str, default: Any, required: bool) -> str:
    if required or default is None or default is False or (isinstance(default, (str, list)) and not default):
        return text
    shown = ",".join(map(str, default)) if isinstance(default, (list, tuple)) else default
    return f"{text} (default {shown})" if text else f"default {shown}"


def add_settings_arguments(parser: argparse.ArgumentParser, cls: type, *, set_option: bool = True,
                           skip: Iterable[str] = ()) -> None:
    """Add one flag per CLI setting of `cls` (and `--set KEY=VALUE`); the parser's defaults are the dataclass's."""
    hints = _hints(cls)
    skip = set(skip)
    # retired settings given as flags: the stage's parser (utils/stage_parser.py) says they were retired
    parser.retired = tuple(getattr(cls, "RETIRED", ()))  # type: ignore[attr-defined]
    for f in dataclasses.fields(cls):
        meta = f.metadata
        if not meta.get("cli", True) or f.name in skip:
            continue
        hint, default = hints[f.name], _default(f)
        text = ("experimental: " if is_experimental(f) else "") + meta.get("help", "")
        kw: dict[str, Any] = {"help": _help(text, default, meta.get("required", False)), "default": default}
        if meta.get("metavar"):
            kw["metavar"] = meta["metavar"]
        if meta.get("positional"):
            if _is_list(hint):  # the rest of the command line (e.g. `-- STAGE FLAGS...`)
                kw["nargs"] = argparse.REMAINDER
            parser.add_argument(f.name, type=_scalar(hint), **kw)
            continue
        kw["dest"] = f.name
        if _scalar(hint) is bool and not _is_list(hint):
            kw["help"] = text
            parser.add_argument(*flags(f), action=_Bool, **kw)
            continue
        kw["type"] = _scalar(hint)
        valid = choices(cls, f.name)
        if valid:
            kw["choices"] = valid
        if meta.get("required"):
            kw["required"] = True
        listed = _Append if meta.get("commas", True) else _AppendWhole
        parser.add_argument(*flags(f), action=listed if _is_list(hint) else _Store, **kw)
    if set_option:
        section = section_name(cls)
        parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                            help=f"override any setting of this stage: KEY=VALUE or {section}.KEY=VALUE "
                                 f"(values read as YAML; an unknown key is an error)")


def explicit(args: argparse.Namespace) -> set[str]:
    """Dests of the settings given as flags on the command line (not left at their defaults)."""
    return set(getattr(args, _EXPLICIT, set()))


def settings_from_args(cls: type[T], args: argparse.Namespace, base: dict[str, Any] | None = None,
                       prefixes: tuple[str, ...] | None = None) -> T:
    """The settings of a stage command: dataclass defaults < `base` (a YAML section) < `--set` < explicit flags."""
    section = section_name(cls)
    values: dict[str, Any] = {}
    if base:
        values.update(build_settings(cls, base, f"section '{section}'").__dict__)
        values = {k: v for k, v in values.items() if k in base}
    values.update(parse_set(getattr(args, "set", None), cls, prefixes or (section,)))
    given = explicit(args)
    for f in dataclasses.fields(cls):
        if not f.metadata.get("cli", True):
            continue
        if f.name in given or f.metadata.get("positional") or f.metadata.get("required"):
            values[f.name] = getattr(args, f.name)
        elif f.name not in values:
            values[f.name] = getattr(args, f.name, _default(f))
    return build_settings(cls, values, f"{section} settings")


# --- docs ----------------------------------------------------------------------------------------------------------
def _cell(value: Any) -> str:
    if value is None or value == "":
        return "–"
    text = yaml.safe_dump(value, default_flow_style=True).strip().removesuffix("...").strip()
    return f"`{text}`"


def _kind(hint: Any) -> str:
    """A type as the docs show it: `int | None`, `trim | skip`, `list of eagle | speculators`."""
    parts = []
    for arm in typing.get_args(hint) if typing.get_origin(hint) in (Union, types.UnionType) else [hint]:
        if typing.get_origin(arm) is Literal:
            parts += [str(v) for v in typing.get_args(arm)]
        elif typing.get_origin(arm) in (list, tuple):
            parts.append(f"list of {_kind(typing.get_args(arm)[0])}")
        else:
            parts.append("None" if arm is type(None) else _type_name(arm))
    return " | ".join(parts)


EXPERIMENTAL_INTRO = ("Experimental: kept for a rerun at GPU scale, measured on small CPU pools only "
                      "(benchmarks/LOG.md). Their meaning and defaults may change, or they may be retired.")


def _rows(cls: type, fields: list[dataclasses.Field], flags_shown: bool) -> list[str]:
    hints = _hints(cls)
    rows = ["| key | CLI flag | type | default | meaning |", "|---|---|---|---|---|"]
    for f in fields:
        meta = f.metadata
        key = f"`{f.name}`" if meta.get("yaml", True) else f"({f.name})"
        if not (flags_shown and meta.get("cli", True)):
            flag = "–"
        elif meta.get("positional"):
            flag = f"`{f.name.upper()}` (argument)"
        else:
            flag = " ".join(f"`{s}`" for s in flags(f))
        valid = meta.get("choices")
        kind = " | ".join(map(str, valid)) if valid else _kind(hints[f.name])
        default = "required" if meta.get("required") or meta.get("positional") else _cell(_default(f))
        meaning = (meta.get("help", "") + (f" (valid: {meta['valid']})" if meta.get("valid") else "")
                   ).replace("|", "\\|")
        rows.append(f"| {key} | {flag} | {kind.replace('|', chr(92) + '|')} | {default} | {meaning} |")
    return rows


def markdown_table(cls: type, title: str, intro: str = "", flags_shown: bool = True) -> str:
    """The docs of one settings dataclass: key, CLI flag, type, default, meaning; experimental settings in a table
    of their own after the others."""
    parts = [f"## {title}", ""]
    if intro:
        parts += [intro, ""]
    parts += _rows(cls, core_fields(cls), flags_shown)
    experimental = [f for f in dataclasses.fields(cls) if is_experimental(f)]
    if experimental:
        parts += ["", f"### {title}: experimental", "", EXPERIMENTAL_INTRO, "",
                  *_rows(cls, experimental, flags_shown)]
    return "\n".join(parts) + "\n"
