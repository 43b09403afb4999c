"""Command lines from dataclass configs: every field becomes ``--field`` (typed, with its default)."""

from __future__ import annotations

import argparse
import dataclasses
import types
import typing
from pathlib import Path
from typing import Any, TypeVar

T = TypeVar("T")


def _unwrap_optional(tp: Any) -> tuple[Any, bool]:
    """``X | None`` -> (X, True); other types -> (tp, False)."""
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(args) == 1:
            return args[0], True
    return tp, False


def add_dataclass_args(parser: argparse.ArgumentParser, cls: type) -> None:
    """Add one ``--name`` flag per field of ``cls`` (bools get ``--name/--no-name``, lists take several values)."""
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        tp, _ = _unwrap_optional(hints[f.name])
        default = f.default if f.default is not dataclasses.MISSING else (
            f.default_factory() if f.default_factory is not dataclasses.MISSING else None)
        flag = f"--{f.name}"
        if tp is bool:
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=default)
        elif typing.get_origin(tp) in (list, tuple):
            (item,) = set(typing.get_args(tp)) - {Ellipsis}
            parser.add_argument(flag, type=item, nargs="*", default=default)
        elif tp in (int, float, str, Path):
            parser.add_argument(flag, type=tp, default=default)
        elif typing.get_origin(tp) is not dict and not dataclasses.is_dataclass(tp):
            raise TypeError(f"{cls.__name__}.{f.name}: unsupported flag type {tp}")
        # dict / nested dataclass fields keep their defaults (set them from Python or a YAML config)


def parse_config(cls: type[T], argv: list[str] | None = None, description: str | None = None) -> T:
    """Parse ``argv`` into an instance of the dataclass ``cls`` (dict / dataclass fields keep their defaults)."""
    parser = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_dataclass_args(parser, cls)
    return cls(**vars(parser.parse_args(argv)))
