"""The machinery of config sections: a field with its CLI help, the flags made from a section's
fields, and a section built back from parsed flags.

A section is a frozen dataclass whose fields come from `option`; it validates itself when built
and reports every problem at once through `raise_problems`.
"""

from __future__ import annotations

import argparse
import dataclasses
import types
import typing
from dataclasses import field
from typing import Any, Literal, TypeVar

Section = TypeVar("Section")


class ConfigInvalid(ValueError):
    """A setting or combination of settings that cannot run; the message lists every one."""


def option(default: Any, help: str, flag: str | None = None) -> Any:
    """A config field with its CLI help text (and an optional flag name override)."""
    return field(default=default, metadata={"help": help, "flag": flag})


def raise_problems(problems: list[str]) -> None:
    if problems:
        raise ConfigInvalid("; ".join(problems))


def flag_name(f: dataclasses.Field[Any]) -> str:
    return f.metadata.get("flag") or "--" + f.name.replace("_", "-")


def add_section(parser: argparse.ArgumentParser, section: type) -> None:
    """Add one flag per field of a config dataclass."""
    group = parser.add_argument_group(section.__name__)
    add_fields(group, section, list(dataclasses.fields(section)))


def add_fields(
    group: argparse._ArgumentGroup, section: type, fields: list[dataclasses.Field[Any]]
) -> None:
    hints = typing.get_type_hints(section)
    for f in fields:
        kind = _kind(hints[f.name])
        group.add_argument(
            flag_name(f), dest=f.name, default=f.default, help=f.metadata.get("help"), **kind
        )


def _kind(annotation: Any) -> dict[str, Any]:
    origin = typing.get_origin(annotation)
    if annotation is bool:
        return {"action": argparse.BooleanOptionalAction}
    if origin is Literal:
        return {"choices": list(typing.get_args(annotation))}
    if origin in (typing.Union, types.UnionType):
        inner = [a for a in typing.get_args(annotation) if a is not type(None)]
        return _kind(inner[0])
    if origin in (list, tuple):
        (item,) = typing.get_args(annotation)[:1]
        return {"nargs": "*", "type": item}
    return {"type": annotation}


def section_from_args(section: type[Section], args: argparse.Namespace) -> Section:
    values = {f.name: getattr(args, f.name) for f in dataclasses.fields(section)}  # type: ignore[arg-type]
    return section(**values)
