"""Bad input, one table over three surfaces: websocket frames, HTTP /v1/completions, the Python AsyncEngine.

Each bad request gets a typed error of its own (websocket `error` frame with a code, an OpenAI error body
with the HTTP status, an InvalidRequestError - a ValueError - in Python), and a valid request right after
it, on the same connection where there is one, returns the greedy reference text. The last test begins
a shutdown and checks that new requests then get 503 / EngineShutdownError.
"""

from __future__ import annotations

import asyncio
import json
import math
import signal
import time
from collections.abc import AsyncIterator, Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
import pytest_asyncio
from reliability_helpers import ServerProcess, chat_model, start_server, stop
from websockets.exceptions import ConnectionClosed
from websockets.sync.client import ClientConnection, connect

from asyncengine import AsyncEngine, EngineConfig, EngineShutdownError, InvalidRequestError, SamplingParams

pytestmark = [pytest.mark.slow, pytest.mark.timeout(60)]

MAX_LEN = 1024  # --max-model-len of the server and the engine (the model's own limit)
VALID = {"prompt": "hello world", "max_tokens": 6, "temperature": 0, "ignore_eos": True}
FRAME_LIMIT = 2**20  # the server's default --max-frame-bytes (uvicorn's ws_max_size is twice that)
BODY_LIMIT = 10 * 2**20  # the server's default --max-body-bytes


@dataclass(frozen=True)
class Case:
    """One bad input. `prompt`/`params` build the request on every surface unless a raw payload replaces
    it there; `status` is the HTTP status and websocket error code; `py` what the Python API raises."""

    name: str
    prompt: Any = "hello"
    params: dict[str, Any] = field(default_factory=dict)
    status: int = 400
    http_status: int | None = None  # where HTTP answers differently
    py: type[BaseException] | None = InvalidRequestError  # None: the Python API has no such input
    # sent as is (bytes: a binary websocket frame); built lazily and kept out of reprs: some are 10 MB
    ws_raw: Callable[[], str | bytes] | None = field(default=None, repr=False)
    http_raw: Callable[[], bytes] | None = field(default=None, repr=False)
    ws: bool = True
    http: bool = True


def generate_frame(request_id: str, prompt: Any, params: dict[str, Any]) -> dict[str, Any]:
    frame: dict[str, Any] = {"type": "generate", "request_id": request_id, "params": params}
    if prompt is not None:
        frame["prompt_token_ids" if isinstance(prompt, list) else "prompt"] = prompt
    return frame


TEN_MB = BODY_LIMIT + 1024  # 10 MiB and a bit: over both the body and the frame limit

CASES = [
    Case(
        "malformed_json",
        ws_raw=lambda: '{"type": "generate", "request_id": "b", "prompt": ',
        http_raw=lambda: b'{"prompt": "hi", ',
        py=None,
    ),
    Case("json_not_an_object", ws_raw=lambda: '["generate", "hi"]', http_raw=lambda: b'["hi"]', py=None),
    Case("unknown_frame_type", ws_raw=lambda: '{"type": "bogus", "request_id": "b"}', http=False, py=None),
    Case("missing_request_id", ws_raw=lambda: '{"type": "generate", "prompt": "hi"}', http=False, py=None),
    Case("missing_prompt", prompt=None),
    Case("prompt_wrong_type", prompt=123),
    Case("prompt_ids_wrong_type", prompt=[1, "a", 3]),
    Case("prompt_ids_bool", prompt=[1, True]),
    Case("temperature_wrong_type", params={"temperature": "hot"}),
    Case("max_tokens_wrong_type", params={"max_tokens": "many"}),
    Case("stop_wrong_type", params={"stop": 5}),
    Case(
        "params_not_an_object",
        ws_raw=lambda: '{"type": "generate", "request_id": "b", "prompt": "hi", "params": [1]}',
        http=False,
        py=None,
    ),
    # unknown fields are refused on every surface, as OpenAI's HTTP API does (a typo is no request for
    # the default); the fields OpenAI's SDK and vLLM's clients send are all known
    Case("unknown_param", params={"bogus_param": 1}),
    Case("negative_temperature", params={"temperature": -0.5}),
    Case("nan_temperature", params={"temperature": math.nan}),
    Case("infinite_temperature", params={"temperature": math.inf}),
    Case("top_p_zero", params={"top_p": 0.0}),
    Case("top_p_above_one", params={"top_p": 1.5}),
    Case("max_tokens_zero", params={"max_tokens": 0}),
    Case("max_tokens_negative", params={"max_tokens": -3}),
    Case("max_tokens_beyond_context", params={"max_tokens": 100_000}),
    Case("n_too_large", params={"n": 10_000}),
    Case("logprobs_too_many", params={"logprobs": 10_000}),
    Case("empty_prompt", prompt=""),
    Case("empty_prompt_ids", prompt=[]),
    Case("prompt_longer_than_max_model_len", prompt=[5] * (MAX_LEN + 1)),
    Case("token_id_beyond_vocab", prompt=[5, 10**9]),
    Case("token_id_negative", prompt=[5, -1]),
    # a websocket text frame must be UTF-8 (the client library refuses to send otherwise): a binary frame
    # carries the invalid bytes; Python strings cannot hold them, so the Python API gets bytes
    Case(
        "invalid_utf8",
        prompt=b"\xff\xfe",
        ws_raw=lambda: b'{"type": "generate", "request_id": "b", "prompt": "\xff\xfe"}',
        http_raw=lambda: b'{"prompt": "\xff\xfe", "max_tokens": 4}',
    ),
    Case("lone_surrogate", prompt="ab\ud800cd"),  # json.dumps writes the \ud800 escape
    Case("thousands_of_stop_strings", params={"stop": [f"s{i}" for i in range(5000)]}),
    Case("huge_stop_string", params={"stop": ["x" * 100_000]}),
    Case(
        "frame_over_limit",
        ws_raw=lambda: json.dumps(generate_frame("b", "x" * (FRAME_LIMIT + 1), {})),
        status=413,
        http=False,
        py=None,
    ),
    Case(
        "ten_mb",
        ws_raw=lambda: json.dumps(generate_frame("b", "x" * TEN_MB, {})),
        http_raw=lambda: json.dumps({"prompt": "x" * TEN_MB}).encode(),
        status=413,
        py=None,
    ),
    Case("duplicate_request_id"),  # special-cased on each surface; HTTP assigns its own ids
    Case("cancel_unknown_id", http=False),  # Python: abort() of an unknown id returns False
]


def cases(surface: str) -> list[Any]:
    """The rows that exist on `surface` (a raw HTTP body has no Python equivalent, etc.)."""
    return [pytest.param(c, id=c.name) for c in CASES if getattr(c, surface) not in (None, False)]


# -- fixtures ---------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return chat_model(tmp_path_factory)


@pytest.fixture(scope="module")
def server(model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    # not waited for here: the Python tests (first in the file) start their engine while it loads
    srv = start_server(
        model,
        tmp_path_factory.mktemp("bad-input"),
        "--max-model-len",
        str(MAX_LEN),
        "--shutdown-timeout",
        "20",
        "--num-threads",
        "1",
        wait=False,
    )
    yield srv
    stop(srv)  # normally gone already: the last test shuts it down


@pytest.fixture(scope="module")
def http(server: ServerProcess) -> Iterator[httpx.Client]:
    server.wait_ready()
    # one client: building one (its SSL context) costs more than a tiny-model request
    with httpx.Client(base_url=server.base, timeout=60) as client:
        yield client


@pytest.fixture(scope="module")
def reference(http: httpx.Client) -> str:
    """The greedy text of VALID, from the server; the Python API must give the same."""
    r = http.post("/v1/completions", json=VALID)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def engine(model: Path) -> AsyncIterator[AsyncEngine]:
    eng = await AsyncEngine.start(
        EngineConfig(
            model=str(model), dtype="float32", num_kv_blocks=80, max_model_len=MAX_LEN, num_threads=1
        )
    )
    yield eng
    if not eng.closing:  # the shutdown test closes it itself
        await eng.shutdown()


# -- Python -----------------------------------------------------------------------------------------
async def py_text(
    engine: AsyncEngine, prompt: Any, params: SamplingParams, request_id: str | None = None
) -> str:
    text = ""
    async for out in engine.generate(prompt, params, request_id):
        text = out.outputs[0].text
    return text


def valid_params() -> SamplingParams:
    return SamplingParams(max_tokens=VALID["max_tokens"], temperature=0.0, ignore_eos=True)


@pytest.mark.asyncio(loop_scope="module")
@pytest.mark.parametrize("case", cases("py"))
async def test_python(case: Case, server: ServerProcess, engine: AsyncEngine, reference: str) -> None:
    # (server first: it loads in its own process while the engine starts here)
    if case.name == "duplicate_request_id":
        first = asyncio.create_task(
            py_text(engine, "first", SamplingParams(max_tokens=40, ignore_eos=True), "dup")
        )
        await asyncio.sleep(0)  # the first is queued under "dup"
        with pytest.raises(InvalidRequestError, match="already running"):
            await py_text(engine, "second", SamplingParams(), "dup")
        assert len(engine.tokenizer.encode(await asyncio.wait_for(first, 30))) > 0
    elif case.name == "cancel_unknown_id":
        assert await engine.abort("nobody") is False
    else:
        assert case.py is not None and issubclass(case.py, ValueError)  # the design's "typed error in Python"
        with pytest.raises(case.py):
            # from_dict is the Python API's entry for untrusted, JSON-like params
            await py_text(engine, case.prompt, SamplingParams.from_dict(case.params))
    assert await asyncio.wait_for(py_text(engine, VALID["prompt"], valid_params()), 30) == reference
    sched = engine.scheduler
    assert sched is not None and not sched.running and not sched.waiting and not engine.requests


def test_python_constructor_checks_ranges() -> None:
    """The keyword constructor validates too: out-of-range values raise SamplingParamsError (a ValueError)."""
    for bad in (
        {"temperature": -1.0},
        {"temperature": math.nan},
        {"top_p": 0.0},
        {"top_p": 1.01},
        {"max_tokens": 0},
        {"n": 0},
        {"stop": ["s"] * 1000},
    ):
        with pytest.raises(ValueError):
            SamplingParams(**bad)


# -- websocket --------------------------------------------------------------------------------------
def ws_valid(ws: ClientConnection, reference: str, request_id: str = "ok") -> None:
    params = {k: v for k, v in VALID.items() if k != "prompt"}
    ws.send(json.dumps(generate_frame(request_id, VALID["prompt"], params)))
    assert ws_collect(ws, request_id) == reference


def ws_collect(ws: ClientConnection, request_id: str) -> str:
    """The text of `request_id` until its `done` frame (frames of other requests are skipped)."""
    text = ""
    while True:
        frame = json.loads(ws.recv(30))
        if frame.get("request_id") != request_id:
            continue
        assert frame["type"] in ("delta", "done"), frame
        if frame["type"] == "done":
            assert frame["finish_reason"] == "length", frame
            return text
        text += frame["text"]


def ws_error(ws: ClientConnection) -> dict[str, Any]:
    frame = json.loads(ws.recv(30))
    assert frame["type"] == "error" and isinstance(frame["message"], str) and frame["message"], frame
    return frame


def ws_duplicate(ws: ClientConnection, attempts: int = 3) -> None:
    """A second generate under a live request's id gets a 400 of its own; the first runs on unharmed."""
    first = {"max_tokens": 100, "ignore_eos": True}
    for _ in range(attempts):
        ws.send(json.dumps(generate_frame("dup", "first", first)))
        tokens = len(json.loads(ws.recv(30))["token_ids"])  # the first delta: "dup" is live now
        ws.send(json.dumps(generate_frame("dup", "second", {"max_tokens": 4})))
        frames = []
        while (frame := json.loads(ws.recv(30)))["type"] != "done":
            frames.append(frame)
            tokens += len(frame.get("token_ids", []))
        errors = [f for f in frames if f["type"] == "error"]
        if errors:
            assert errors == [
                {"type": "error", "request_id": "dup", "code": 400, "message": errors[0]["message"]}
            ]
            assert frame["usage"]["completion_tokens"] == tokens == 100, frame  # the first carried on
            return
        # NOTE: on a busy machine the first may finish (100 steps) before the second frame is read; the id
        # is free again then, so the second is served as a new request: let it finish and try again
        while json.loads(ws.recv(30))["type"] != "done":
            pass
    pytest.fail(f"the duplicate never arrived while the first request was live ({attempts} attempts)")


@pytest.mark.parametrize("case", cases("ws"))
def test_websocket(case: Case, server: ServerProcess, reference: str) -> None:
    with connect(server.ws_url, open_timeout=20, max_size=None) as ws:
        if case.name == "duplicate_request_id":
            ws_duplicate(ws)
            ws_valid(ws, reference)
            return
        if case.name == "cancel_unknown_id":
            ws.send(json.dumps({"type": "cancel", "request_id": "nobody"}))
            assert ws_error(ws)["code"] == 400
            ws_valid(ws, reference)
            return
        ws.send(
            case.ws_raw()
            if case.ws_raw is not None
            else json.dumps(generate_frame("b", case.prompt, case.params))
        )
        try:
            frame = ws_error(ws)
        except ConnectionClosed as closed:
            # over uvicorn's ws_max_size the protocol layer closes the connection with 1009 (message too
            # big) before the app sees the frame: typed too; a new connection must then work
            assert case.status == 413 and closed.rcvd is not None and closed.rcvd.code == 1009, closed
        else:
            assert frame["code"] == case.status, frame
            ws_valid(ws, reference)
            return
    with connect(server.ws_url, open_timeout=20) as ws:
        ws_valid(ws, reference)


# -- HTTP -------------------------------------------------------------------------------------------
def http_body(case: Case) -> bytes:
    if case.http_raw is not None:
        return case.http_raw()
    body: dict[str, Any] = dict(case.params)
    if case.prompt is not None:
        body["prompt"] = case.prompt
    return json.dumps(body).encode()


@pytest.mark.parametrize("case", cases("http"))
def test_http(case: Case, http: httpx.Client, reference: str) -> None:
    if case.name == "duplicate_request_id":
        # HTTP assigns request ids itself: concurrent identical requests must not collide
        with ThreadPoolExecutor(4) as pool:
            texts = list(pool.map(lambda _: http.post("/v1/completions", json=VALID).json(), range(4)))
        assert [t["choices"][0]["text"] for t in texts] == [reference] * 4
        assert len({t["id"] for t in texts}) == 4
        return
    try:
        r = http.post(
            "/v1/completions", content=http_body(case), headers={"Content-Type": "application/json"}
        )
    except httpx.WriteError:
        # the server may answer 413 and close while a 10 MB body is still being written
        assert case.status == 413
    else:
        want = case.http_status or case.status
        assert r.status_code == want, r.text
        if want != 200:
            err = r.json()["error"]
            assert err["code"] == want and err["type"] and err["message"], err
    r = http.post("/v1/completions", json=VALID)
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == reference, r.text


# -- after shutdown began (last: it ends the module's server and engine) ------------------------------
@pytest.mark.asyncio(loop_scope="module")
async def test_requests_after_shutdown_began(server: ServerProcess, engine: AsyncEngine) -> None:
    # Python: shutdown() marks the engine closing before its first await
    long = asyncio.create_task(py_text(engine, "long", SamplingParams(max_tokens=100, ignore_eos=True)))
    await asyncio.sleep(0.05)
    closing = asyncio.create_task(engine.shutdown())
    await asyncio.sleep(0)
    with pytest.raises(EngineShutdownError):
        engine.generate(VALID["prompt"], valid_params())
    await asyncio.wait_for(closing, 30)
    await asyncio.wait_for(long, 5)  # ended (aborted), not hung
    with pytest.raises(EngineShutdownError):
        engine.generate(VALID["prompt"], valid_params())

    # server: a live websocket request keeps the drain going (--shutdown-timeout 20); meanwhile new
    # requests on already open connections get 503, and new connections are refused
    def server_side() -> None:
        with (
            connect(server.ws_url, open_timeout=20) as ws,
            httpx.Client(base_url=server.base, timeout=10) as http,
        ):
            assert http.get("/health").status_code == 200  # opens the keep-alive connection
            # ~1,000 steps: it outlives the checks below by far, so the drain is still waiting for it
            ws.send(json.dumps(generate_frame("long", "x", {"max_tokens": MAX_LEN - 8, "ignore_eos": True})))
            assert json.loads(ws.recv(30))["type"] == "delta"
            server.proc.send_signal(signal.SIGTERM)
            deadline = time.monotonic() + 10
            while http.get("/health").status_code == 200:
                assert time.monotonic() < deadline
                time.sleep(0.02)
            r = http.post("/v1/completions", json=VALID)
            assert r.status_code == 503 and r.json()["error"]["code"] == 503, r.text
            ws.send(json.dumps(generate_frame("late", VALID["prompt"], {})))
            while (frame := json.loads(ws.recv(30)))["request_id"] != "late":
                pass
            assert frame["type"] == "error" and frame["code"] == 503, frame
        with pytest.raises(httpx.TransportError):
            httpx.post(f"{server.base}/v1/completions", json=VALID, timeout=5)
        assert server.proc.wait(30) == 0

    await asyncio.to_thread(server_side)
