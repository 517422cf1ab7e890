"""Typed, frozen configuration sections; the command line is generated from them.

Every section validates itself when built, so a bad setting stops the start with one message
instead of surfacing later. Flag names follow SGLang's where SGLang has the setting.
"""

from __future__ import annotations

import argparse
import dataclasses
import types
import typing
from dataclasses import dataclass, field
from typing import Any, Literal, TypeVar

Section = TypeVar("Section")


class ConfigInvalid(ValueError):
    """A setting or combination of settings that cannot run; the message lists every one."""


def option(default: Any, help: str, flag: str | None = None) -> Any:
    """A config field with its CLI help text (and an optional flag name override)."""
    return field(default=default, metadata={"help": help, "flag": flag})


@dataclass(frozen=True)
class ModelArgs:
    model_path: str | None = option(
        None, "checkpoint directory; default: the built-in tiny M3.1 checkpoint"
    )
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = option(
        "auto", "compute dtype; auto = float32 on CPU, the checkpoint's dtype on GPU"
    )
    trust_remote_code: bool = option(False, "accepted for SGLang compatibility; no code is run")


@dataclass(frozen=True)
class BackendArgs:
    backend: Literal["auto", "reference", "hopper", "blackwell", "rocm"] = option(
        "auto", "kernel backend; auto picks by device"
    )
    device: str = option("auto", "torch device: auto, cpu, cuda, cuda:N")

    def __post_init__(self) -> None:
        if self.device != "auto" and not self.device.startswith(("cpu", "cuda")):
            raise ConfigInvalid(f"--device {self.device!r}: expected auto, cpu, cuda or cuda:N")


def add_section(parser: argparse.ArgumentParser, section: type) -> None:
    """Add one flag per field of a config dataclass."""
    group = parser.add_argument_group(section.__name__)
    hints = typing.get_type_hints(section)
    for f in dataclasses.fields(section):
        flag = f.metadata.get("flag") or "--" + f.name.replace("_", "-")
        kind = _kind(hints[f.name])
        help_text = f.metadata.get("help")
        group.add_argument(flag, dest=f.name, default=f.default, help=help_text, **kind)


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
