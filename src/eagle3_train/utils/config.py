"""YAML run configs with command-line overrides (`--set train.lr=3e-4`), mapped onto stage dataclasses."""

from __future__ import annotations

from pathlib import Path
from typing import Any, TypeVar

import yaml

from eagle3_train.utils.io import Eagle3InputError

T = TypeVar("T")


class _UniqueKeys(yaml.SafeLoader):
    """YAML that refuses a key given twice in one mapping (PyYAML keeps the last one without a word)."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: dict[Any, int] = {}
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            if key in seen:
                raise yaml.constructor.ConstructorError(
                    None, None, f"key {key!r} is given twice (lines {seen[key] + 1} and "
                                f"{key_node.start_mark.line + 1}); keep one", key_node.start_mark)
            seen[key] = key_node.start_mark.line
        return super().construct_mapping(node, deep=deep)


def load_yaml(path: str | Path) -> dict[str, Any]:
    path = Path(path)
    if not path.is_file():
        raise Eagle3InputError(f"config file not found: {path}")
    try:
        data = yaml.load(path.read_text(), Loader=_UniqueKeys) or {}  # noqa: S506 - a SafeLoader
    except yaml.YAMLError as e:
        raise Eagle3InputError(f"config file {path} is not valid YAML: {e}") from None
    if not isinstance(data, dict):
        raise Eagle3InputError(f"config file {path} must hold a mapping at the top level")
    return data


def apply_overrides(config: dict[str, Any], overrides: list[str] | None) -> dict[str, Any]:
    """Apply `a.b.c=value` overrides; values are parsed as YAML (numbers, booleans, lists)."""
    for item in overrides or []:
        if "=" not in item:
            raise Eagle3InputError(f"override '{item}' must look like section.key=value")
        key, raw = item.split("=", 1)
        node = config
        parts = key.strip().split(".")
        for p in parts[:-1]:
            node = node.setdefault(p, {})
            if not isinstance(node, dict):
                raise Eagle3InputError(f"override '{item}': '{p}' is not a section")
        try:
            node[parts[-1]] = yaml.safe_load(raw)
        except yaml.YAMLError as e:
            raise Eagle3InputError(f"--set '{item}': the value is not valid YAML ({str(e).splitlines()[0]})") from None
    return config


def to_dataclass(cls: type[T], values: dict[str, Any], where: str) -> T:
    """Build a settings dataclass, naming an unknown key (with the closest valid one) and the section it came from."""
    from eagle3_train.utils.settings import build_settings

    return build_settings(cls, values, where)
