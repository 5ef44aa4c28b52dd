"""argparse flags generated from EngineConfig's fields; each also settable as ASYNCENGINE_<FIELD>.

Precedence: command-line flag > environment variable > the field's default.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import types
import typing
from typing import Any

from asyncengine.config import EngineConfig
from asyncengine.errors import ConfigError


def _base_type(f: dataclasses.Field) -> tuple[Any, bool]:
    """(scalar type, is_tuple) of a field annotated like `int | None` or `tuple[int, ...] | None`."""
    hint = typing.get_type_hints(EngineConfig)[f.name]
    args = [a for a in typing.get_args(hint) if a is not type(None)] if _is_union(hint) else [hint]
    inner = args[0]
    if typing.get_origin(inner) is tuple:
        return typing.get_args(inner)[0], True
    return inner, False


def _is_union(hint: Any) -> bool:
    return typing.get_origin(hint) in (typing.Union, types.UnionType)


def parse_field(f: dataclasses.Field, raw: str) -> Any:
    kind, is_tuple = _base_type(f)
    try:
        if raw.lower() in ("none", "") and f.default is None:
            return None
        if is_tuple:
            return tuple(kind(x) for x in raw.replace(",", " ").split())
        if kind is bool:
            if raw.lower() in ("1", "true", "yes", "on"):
                return True
            if raw.lower() in ("0", "false", "no", "off"):
                return False
            raise ValueError(raw)
        return kind(raw)
    except ValueError:
        raise ConfigError(f"invalid value for {f.name}: {raw!r}") from None


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    for f in dataclasses.fields(EngineConfig):
        flag = "--" + f.name.replace("_", "-")
        names = [flag] + ([f.metadata["short"]] if "short" in f.metadata else [])
        kind, is_tuple = _base_type(f)
        help_text = f.metadata.get("help", "") + f" [env ASYNCENGINE_{f.name.upper()}]"
        if kind is bool and not is_tuple:
            parser.add_argument(*names, dest=f.name, action=argparse.BooleanOptionalAction, default=None,
                                help=help_text)
        else:
            parser.add_argument(*names, dest=f.name, default=None, type=str, help=help_text,
                                metavar=f.name.upper())


def config_from_args(args: argparse.Namespace) -> EngineConfig:
    values: dict[str, Any] = {}
    for f in dataclasses.fields(EngineConfig):
        env = os.environ.get(f"ASYNCENGINE_{f.name.upper()}")
        cli = getattr(args, f.name, None)
        if cli is not None:
            values[f.name] = cli if isinstance(cli, bool) else parse_field(f, cli)
        elif env is not None:
            values[f.name] = parse_field(f, env)
    return EngineConfig(**values)
