"""argparse flags generated from EngineConfig's fields; each also settable as ASYNCENGINE_<FIELD>.

Precedence: command-line flag > environment variable > the field's default.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import types
import typing
from pathlib import Path
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


# what a field's default means, where the bare value (None, a long path) would not say
DEFAULT_TEXT = {
    "model": "the bundled default model, a few-million-parameter toy trained on Python code, served as "
    "'default-model'",
    "num_threads": "the node's cores / its workers",
    "cuda_graph_sizes": "1, 2, 4, 8, then every 8 from 16 up to --max-num-seqs",
    "head_port": "none",
    "key_file": "none",
}
HELP_TEXT = {
    "model": "a local HuggingFace model directory (config.json + *.safetensors; Hub ids are not downloaded)",
}


def field_help(f: dataclasses.Field) -> str:
    """The field's help, its default (or the environment variable's value in its place) and its variable."""
    env = f"ASYNCENGINE_{f.name.upper()}"
    text = HELP_TEXT.get(f.name) or f.metadata.get("help", "") or f.name.replace("_", " ")
    if env in os.environ:
        default = f"{os.environ[env]!r} from {env}"
    elif f.name in DEFAULT_TEXT:
        default = DEFAULT_TEXT[f.name]
    elif "(default:" in text:
        default = ""
    else:
        value = f.default
        if isinstance(value, bool):
            value = "on" if value else "off"
        elif isinstance(value, tuple):
            value = ",".join(map(str, value))
        default = "none" if value is None else str(value)
    suffix = f" (default: {default}; env {env})" if default else f" [env {env}]"
    return (text + suffix).replace("%", "%%")  # argparse %-formats help strings


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    for f in dataclasses.fields(EngineConfig):
        flag = "--" + f.name.replace("_", "-")
        names = [flag] + ([f.metadata["short"]] if "short" in f.metadata else [])
        kind, is_tuple = _base_type(f)
        help_text = field_help(f)
        if kind is bool and not is_tuple:
            parser.add_argument(
                *names, dest=f.name, action=argparse.BooleanOptionalAction, default=None, help=help_text
            )
        else:
            parser.add_argument(
                *names, dest=f.name, default=None, type=str, help=help_text, metavar=f.name.upper()
            )


def config_from_args(args: argparse.Namespace) -> EngineConfig:
    values: dict[str, Any] = {}
    for f in dataclasses.fields(EngineConfig):
        env = os.environ.get(f"ASYNCENGINE_{f.name.upper()}")
        cli = getattr(args, f.name, None)
        if cli is not None:
            values[f.name] = cli if isinstance(cli, bool) else parse_field(f, cli)
        elif env is not None:
            values[f.name] = parse_field(f, env)
    config = EngineConfig(**values)
    if not (Path(config.model) / "config.json").is_file():  # before the server binds or prints anything
        raise ConfigError(
            f"{config.model} has no config.json: --model takes a HuggingFace model directory "
            "(config.json, *.safetensors and the tokenizer files)"
        )
    return config
