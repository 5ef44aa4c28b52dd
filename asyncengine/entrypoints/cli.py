"""The `asyncengine` command: `serve` (HTTP/OpenAI + websocket server) and `generate` (one prompt to stdout).

Engine flags come from EngineConfig's fields (see config_args); serving flags are below. Every flag is
also settable as ASYNCENGINE_<FLAG> (e.g. ASYNCENGINE_PORT, ASYNCENGINE_API_KEY); the flag wins.
`--help` and `--version` import neither torch nor the engine.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
from collections.abc import Sequence
from typing import Any

from asyncengine.entrypoints.config_args import add_engine_args, config_from_args
from asyncengine.entrypoints.logging_config import LOG_LEVELS, configure_logging
from asyncengine.errors import AsyncEngineError

# --tool-call-parser's values (vLLM's names); tool_parsers.pick_parser knows each but "auto" (the template's)
TOOL_CALL_PARSERS = ("auto", "hermes", "llama3_json", "none")
DESCRIPTION = (
    "An LLM inference engine: `asyncengine serve` serves the OpenAI API and a websocket on "
    "http://127.0.0.1:8000; without --model it serves the bundled default model, a toy that "
    "completes Python code."
)


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


def _csv(raw: str) -> list[str]:
    return [x.strip() for x in raw.split(",") if x.strip()]


def _seconds(raw: str) -> float:
    value = float(raw)
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {raw}")
    return value


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows each option's default, unless its help says it already or the default is no value."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if "%(default)" in text or "(default:" in text or not action.option_strings:
            return text
        if isinstance(action.default, bool):
            return text + (" (default: on)" if action.default else " (default: off)")
        if action.default in (None, argparse.SUPPRESS):
            return text
        return text + " (default: %(default)s)"


class VersionAction(argparse.Action):
    """`--version`: the installed package's version (read only when asked)."""

    def __init__(self, option_strings: Sequence[str], dest: str = argparse.SUPPRESS, **kwargs: Any) -> None:
        super().__init__(
            option_strings, dest, nargs=0, default=argparse.SUPPRESS, help="print the version and exit"
        )

    def __call__(self, parser: argparse.ArgumentParser, *args: Any) -> None:
        print(f"asyncengine {version()}", flush=True)
        parser.exit()


def version() -> str:
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as package_version

    try:
        return package_version("asyncengine")
    except PackageNotFoundError:  # a source tree on sys.path, not installed
        return "unknown (not installed)"


def add_serve_args(p: argparse.ArgumentParser) -> None:
    from asyncengine.entrypoints.http_protocol import ConnectionLimits
    from asyncengine.entrypoints.server_state import ServerLimits

    d, c = ServerLimits(), ConnectionLimits()
    g = p.add_argument_group("serving (each also ASYNCENGINE_<FLAG>)")
    g.add_argument(
        "--host", default=_env("host", "127.0.0.1"), help="address to listen on (0.0.0.0: every interface)"
    )
    g.add_argument(
        "--port", type=int, default=_env("port", 8000), help="port to listen on (0: any free port)"
    )
    g.add_argument(
        "--api-key",
        default=_env("api_key", None),
        help="require 'Authorization: Bearer KEY' on /v1 (default: none, no key needed; prefer "
        "ASYNCENGINE_API_KEY: flags show in ps)",
    )
    g.add_argument(
        "--served-model-name",
        default=_env("served_model_name", None),
        help="the model's name in the API, the `model` clients send (default: the model directory's "
        "name, 'default-model' for the bundled one)",
    )
    g.add_argument(
        "--shutdown-timeout",
        type=_seconds,
        default=_env("shutdown_timeout", 30.0),
        help="seconds live requests may finish after SIGINT/SIGTERM before they are aborted",
    )
    g.add_argument(
        "--max-live-requests",
        type=_positive_int,
        default=_env("max_live_requests", d.max_live_requests),
        help="generating requests over all connections (429 beyond)",
    )
    g.add_argument(
        "--max-live-per-connection",
        type=_positive_int,
        default=_env("max_live_per_connection", d.max_live_per_connection),
        help="generating requests on one websocket (429 beyond)",
    )
    g.add_argument(
        "--max-body-bytes",
        type=_positive_int,
        default=_env("max_body_bytes", d.max_body_bytes),
        help="largest HTTP request body (413 beyond)",
    )
    g.add_argument(
        "--max-frame-bytes",
        type=_positive_int,
        default=_env("max_frame_bytes", d.max_frame_bytes),
        help="largest websocket frame (error 413 beyond, connection closed with 1009 beyond twice)",
    )
    # slow clients (slowloris) and connection count: each HTTP connection is bounded in time and number
    g.add_argument(
        "--timeout-header",
        type=_seconds,
        default=_env("timeout_header", c.header_timeout_s),
        help="seconds for a request's line and headers, from connect or its first byte (408 and "
        "close beyond; 0: no limit)",
    )
    g.add_argument(
        "--timeout-body",
        type=_seconds,
        default=_env("timeout_body", c.body_timeout_s),
        help="seconds for a whole request body, from the end of its headers (408 and close beyond; "
        "0: no limit)",
    )
    g.add_argument(
        "--timeout-keep-alive",
        type=_seconds,
        default=_env("timeout_keep_alive", c.keep_alive_s),
        help="seconds an idle connection is kept open between requests",
    )
    g.add_argument(
        "--max-connections",
        type=_positive_int,
        default=_env("max_connections", c.max_connections),
        help="open connections, websockets included (requests beyond get 503)",
    )
    g.add_argument(
        "--restart-workers",
        action=argparse.BooleanOptionalAction,
        default=_env_flag("restart_workers"),
        help="when a worker dies or stops answering, start new workers and keep serving (/health is "
        "503 meanwhile) instead of exiting with status 1",
    )
    g.add_argument(
        "--log-level",
        default=_env("log_level", "info"),
        choices=LOG_LEVELS,
        help="least severe log lines printed on stderr",
    )
    g.add_argument(
        "--log-stats-interval",
        type=_seconds,
        default=_env("log_stats_interval", 5.0),
        help="seconds between throughput lines (tokens/s, running and waiting sequences, KV cache "
        "usage) logged while requests run; none while idle (0: never)",
    )
    g.add_argument(
        "--allowed-origins",
        type=_csv,
        default=_csv(_env("allowed_origins", "")),
        help="comma-separated origins (scheme://host:port, or *) whose browser pages may use the API and "
        "websocket, with CORS answers (default: only pages the server itself serves)",
    )
    g.add_argument(
        "--allowed-hosts",
        type=_csv,
        default=_csv(_env("allowed_hosts", "")),
        help="comma-separated Host header names answered (or *), against DNS rebinding (default: the "
        "loopback names for a loopback --host, any for 0.0.0.0/::, else --host and loopback)",
    )
    g.add_argument(
        "--access-log",
        action=argparse.BooleanOptionalAction,
        default=_env_flag("access_log"),
        help="log every HTTP request (client, method, path, status)",
    )
    g.add_argument(
        "--tool-call-parser",
        default=_env("tool_call_parser", "auto"),
        choices=TOOL_CALL_PARSERS,
        help="how tool_choice 'auto' finds the model's tool calls in its text: hermes (<tool_call> "
        "tags: Hermes, Qwen), llama3_json (Llama 3's JSON), none (never: the text is the answer), or "
        "auto (the one the chat template writes; none if it writes neither)",
    )
    # a client that does not read its output: its requests are aborted and it is closed
    g.add_argument(
        "--max-unsent-bytes",
        type=_positive_int,
        default=_env("max_unsent_bytes", d.max_unsent_bytes),
        help="output one websocket connection or SSE response may have unsent before its requests "
        "are aborted and it is closed",
    )
    g.add_argument(
        "--send-stall-timeout",
        type=_seconds,
        default=_env("send_stall_timeout", d.send_stall_timeout),
        help="seconds one send to a client that does not read may wait before its requests are "
        "aborted and it is closed (0: no limit)",
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="asyncengine", description=DESCRIPTION, formatter_class=HelpFormatter
    )
    parser.add_argument("--version", action=VersionAction)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    serve_help = "serve the OpenAI-compatible HTTP API and the /v1/ws websocket"
    serve = sub.add_parser(
        "serve",
        help=serve_help,
        description=serve_help + "; without --model, the bundled default model",
        formatter_class=HelpFormatter,
    )
    add_engine_args(serve)
    add_serve_args(serve)
    gen_help = "stream one completion of a prompt to stdout"
    gen = sub.add_parser(
        "generate",
        help=gen_help,
        description=gen_help + " (--seed also seeds the request)",
        formatter_class=HelpFormatter,
    )
    add_engine_args(gen)
    gen.add_argument("--max-tokens", type=_positive_int, default=64, help="most tokens to generate")
    gen.add_argument("--temperature", type=float, default=1.0, help="sampling temperature (0: greedy)")
    gen.add_argument(
        "--top-p",
        type=float,
        default=1.0,
        help="nucleus sampling: the smallest set of tokens whose probabilities add up to this",
    )
    gen.add_argument(
        "--ignore-eos",
        action="store_true",
        help="keep generating past the end-of-text token (default: stop there)",
    )
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
    from asyncengine.entrypoints.guard import OriginPolicy
    from asyncengine.entrypoints.http_protocol import ConnectionLimits
    from asyncengine.entrypoints.launcher import ServeOptions, run
    from asyncengine.entrypoints.server_state import ServerLimits

    config = config_from_args(args)
    policy = OriginPolicy.for_bind(args.host, args.allowed_hosts, args.allowed_origins)
    limits = ServerLimits(
        args.max_live_requests,
        args.max_live_per_connection,
        args.max_body_bytes,
        args.max_frame_bytes,
        max_unsent_bytes=args.max_unsent_bytes,
        send_stall_timeout=args.send_stall_timeout,
    )
    connections = ConnectionLimits(
        args.timeout_header, args.timeout_body, args.timeout_keep_alive, args.max_connections
    )
    opts = ServeOptions(
        args.host,
        args.port,
        args.api_key or None,
        args.served_model_name,
        args.shutdown_timeout,
        limits,
        args.log_level,
        args.access_log,
        args.restart_workers,
        connections,
        policy,
        args.log_stats_interval,
        args.tool_call_parser,
    )
    return run(config, opts)


def cmd_generate(args: argparse.Namespace) -> int:
    from asyncengine.entrypoints.launcher import run_loop

    config = config_from_args(args)
    prompt = sys.stdin.read() if args.prompt == "-" else args.prompt
    return run_loop(_generate(config, prompt, args))


async def _generate(config: Any, prompt: str, args: argparse.Namespace) -> int:
    from asyncengine.engine import AsyncEngine
    from asyncengine.sampling_params import OutputKind, SamplingParams

    params = SamplingParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        seed=None if args.seed is None else config.seed,
        ignore_eos=args.ignore_eos,
        output_kind=OutputKind.DELTA,
    )
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
    configure_logging(getattr(args, "log_level", "warning"))
    try:
        return args.func(args)
    except (AsyncEngineError, OSError) as e:
        print(f"asyncengine: error: {e}", file=sys.stderr, flush=True)
        return 1
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
