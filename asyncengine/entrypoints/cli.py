"""The `asyncengine` command: `serve` (HTTP/OpenAI + websocket server) and `generate` (one prompt to stdout).

Engine flags come from EngineConfig's fields (see config_args); serving flags are below. Every flag is
also settable as ASYNCENGINE_<FLAG> (e.g. ASYNCENGINE_PORT, ASYNCENGINE_API_KEY); the flag wins.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys
from collections.abc import Sequence
from typing import Any

from asyncengine.entrypoints.config_args import add_engine_args, config_from_args
from asyncengine.errors import AsyncEngineError


def _env(name: str, default: Any) -> Any:
    """The ASYNCENGINE_<NAME> value (argparse converts string defaults with the flag's type)."""
    return os.environ.get(f"ASYNCENGINE_{name.upper()}", default)


def _env_flag(name: str) -> bool:
    """A boolean ASYNCENGINE_<NAME> (1/true/yes/on); unset is False."""
    return str(_env(name, "")).strip().lower() in ("1", "true", "yes", "on")


def _positive_int(raw: str) -> int:
    value = int(raw)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def _seconds(raw: str) -> float:
    value = float(raw)
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {raw}")
    return value


def add_serve_args(p: argparse.ArgumentParser) -> None:
    from asyncengine.entrypoints.server import ServerLimits

    d = ServerLimits()
    g = p.add_argument_group("serving (each also ASYNCENGINE_<FLAG>)")
    g.add_argument("--host", default=_env("host", "127.0.0.1"), help="address to listen on")
    g.add_argument("--port", type=int, default=_env("port", 8000), help="port (0: any free port)")
    g.add_argument("--api-key", default=_env("api_key", None),
                   help="require 'Authorization: Bearer KEY' on /v1 (prefer ASYNCENGINE_API_KEY: flags show in ps)")
    g.add_argument("--served-model-name", default=_env("served_model_name", None),
                   help="model name in the API (default: the model directory's name)")
    g.add_argument("--shutdown-timeout", type=_seconds, default=_env("shutdown_timeout", 30.0),
                   help="seconds live requests may finish after SIGINT/SIGTERM before they are aborted")
    g.add_argument("--max-live-requests", type=_positive_int, default=_env("max_live_requests", d.max_live_requests),
                   help="generating requests over all connections (429 beyond)")
    g.add_argument("--max-live-per-connection", type=_positive_int,
                   default=_env("max_live_per_connection", d.max_live_per_connection),
                   help="generating requests on one websocket (429 beyond)")
    g.add_argument("--max-body-bytes", type=_positive_int, default=_env("max_body_bytes", d.max_body_bytes),
                   help="largest HTTP request body (413 beyond)")
    g.add_argument("--max-frame-bytes", type=_positive_int, default=_env("max_frame_bytes", d.max_frame_bytes),
                   help="largest websocket frame (error 413 beyond, connection closed with 1009 beyond twice)")
    g.add_argument("--restart-workers", action=argparse.BooleanOptionalAction, default=_env_flag("restart_workers"),
                   help="when a worker dies or stops answering, start new workers and keep serving (/health is "
                        "503 meanwhile) instead of exiting with status 1")
    g.add_argument("--log-level", default=_env("log_level", "info"),
                   choices=["critical", "error", "warning", "info", "debug"])
    g.add_argument("--access-log", action=argparse.BooleanOptionalAction, default=False,
                   help="log every HTTP request")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="asyncengine", description="LLM inference engine")
    sub = parser.add_subparsers(dest="command", required=True)
    serve = sub.add_parser("serve", help="serve the OpenAI-compatible HTTP API and the /v1/ws websocket")
    add_engine_args(serve)
    add_serve_args(serve)
    gen = sub.add_parser("generate", help="stream one completion to stdout (--seed also seeds the request)")
    add_engine_args(gen)
    gen.add_argument("--max-tokens", type=_positive_int, default=64)
    gen.add_argument("--temperature", type=float, default=1.0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--ignore-eos", action="store_true")
    gen.add_argument("prompt", help="the prompt; '-' reads it from stdin")
    serve.set_defaults(func=cmd_serve)
    gen.set_defaults(func=cmd_generate)
    try:  # `asyncengine worker`: this node's workers of a multi-node engine
        from asyncengine.entrypoints.worker_cli import add_worker_parser
    except ImportError:
        pass
    else:
        add_worker_parser(sub)
    return parser


def cmd_serve(args: argparse.Namespace) -> int:
    from asyncengine.entrypoints.launcher import ServeOptions, run
    from asyncengine.entrypoints.server import ServerLimits

    config = config_from_args(args)
    limits = ServerLimits(args.max_live_requests, args.max_live_per_connection, args.max_body_bytes,
                          args.max_frame_bytes)
    opts = ServeOptions(args.host, args.port, args.api_key or None, args.served_model_name, args.shutdown_timeout,
                        limits, args.log_level, args.access_log, args.restart_workers)
    return run(config, opts)


def cmd_generate(args: argparse.Namespace) -> int:
    from asyncengine.entrypoints.launcher import run_loop

    config = config_from_args(args)
    prompt = sys.stdin.read() if args.prompt == "-" else args.prompt
    return run_loop(_generate(config, prompt, args))


async def _generate(config: Any, prompt: str, args: argparse.Namespace) -> int:
    from asyncengine.engine import AsyncEngine
    from asyncengine.sampling_params import OutputKind, SamplingParams

    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                            seed=None if args.seed is None else config.seed, ignore_eos=args.ignore_eos,
                            output_kind=OutputKind.DELTA)
    engine = await AsyncEngine.start(config)
    try:
        async for out in engine.generate(prompt, params):
            sys.stdout.write(out.outputs[0].text)
            sys.stdout.flush()
        sys.stdout.write("\n")
        sys.stdout.flush()
    finally:
        await asyncio.shield(engine.shutdown())
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=getattr(args, "log_level", "warning").upper(), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        return args.func(args)
    except (AsyncEngineError, OSError) as e:
        print(f"asyncengine: error: {e}", file=sys.stderr, flush=True)
        return 1
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
