"""Property-based fuzzing of every request field: arbitrary JSON values (huge and negative ints, floats
with inf/nan/1e308, wrong types, nested lists and objects) thrown one field at a time at SamplingParams,
the HTTP bodies of /v1/completions and /v1/chat/completions, and the websocket's generate frames.

The properties: SamplingParams either refuses a value with SamplingParamsError or accepts one that the
step encoding can carry to the workers; the server answers every request with 200 or a 4xx (never a 5xx,
a hang or a dropped connection) and is healthy after each. Examples are derandomized, so a failure
reproduces on every run; each test states its example count.
"""

from __future__ import annotations

import itertools
import json
import math
from collections.abc import Iterator
from typing import Any

import httpx
import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from reliability_helpers import ServerProcess, chat_model, start_server, stop
from websockets.sync.client import ClientConnection, connect

from asyncengine.sampling_params import SamplingParams, SamplingParamsError
from asyncengine.transport.wire import SamplingOptions, pack_ids

EXAMPLES = 150  # per test and field set; see the module docstring
FIELDS = list(SamplingParams.__struct_fields__)
EDGE_INTS = [
    2**31 - 1,
    2**31,
    2**32,
    2**63 - 1,
    2**63,
    2**64,
    2**70,
    10**30,
    -1,
    -(2**31),
    -(2**63) - 1,
    -(2**70),
]
EDGE_FLOATS = [0.0, -0.0, 1e-320, 1e308, -1e308, float("inf"), float("-inf"), float("nan")]

scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.sampled_from(EDGE_INTS),
    st.integers(),
    st.integers(-5, 70),
    st.sampled_from(EDGE_FLOATS),
    st.floats(),
    st.text(max_size=20),
    st.sampled_from(["4", "1e9", "", "-1"]),
)
json_values = st.recursive(
    scalars,
    lambda inner: st.one_of(
        st.lists(inner, max_size=5), st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=12,
)
FUZZ = settings(
    max_examples=EXAMPLES,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)


def dumps(body: Any) -> str:
    return json.dumps(body, allow_nan=True)  # NaN / Infinity too: what a hostile client may send


@settings(FUZZ, max_examples=4 * EXAMPLES)  # no server: cheap, so more of them
@given(field=st.sampled_from(FIELDS), value=json_values, min_tokens=st.sampled_from([None, 0, 1, 2**70]))
def test_sampling_params_refuse_or_encode(field: str, value: Any, min_tokens: Any) -> None:
    fields = {field: value}
    if min_tokens is not None and field != "min_tokens":
        fields.update(min_tokens=min_tokens, max_tokens=None)  # the combination that banned huge stop ids
    try:
        p = SamplingParams.from_dict(fields)
    except SamplingParamsError:
        return
    # accepted: what the engine derives from it must encode for the workers
    options = SamplingOptions(
        temperature=p.temperature,
        top_p=p.top_p,
        top_k=p.top_k,
        min_p=p.min_p,
        seed=p.seed,
        presence_penalty=p.presence_penalty,
        frequency_penalty=p.frequency_penalty,
        repetition_penalty=p.repetition_penalty,
        logprobs=p.logprobs,
        min_tokens=p.min_tokens,
        min_tokens_banned_ids=p.stop_token_ids,
    )
    msgspec.msgpack.encode(options)
    pack_ids(p.stop_token_ids)
    assert all(math.isfinite(x) for x in (p.temperature, p.top_p, p.min_p, p.repetition_penalty))
    assert p.max_tokens is None or 1 <= p.max_tokens < 2**31


# -- against a real server ------------------------------------------------------------------------
@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    srv = start_server(
        chat_model(tmp_path_factory), tmp_path_factory.mktemp("fuzz"), "--max-model-len", "256"
    )
    yield srv
    stop(srv)


def check_alive(server: ServerProcess, http: httpx.Client) -> None:
    assert server.proc.poll() is None, "the server exited"
    assert http.get(f"{server.base}/health").status_code == 200


COMPLETION_FIELDS = [
    "model",
    "prompt",
    "n",
    "temperature",
    "top_p",
    "stop",
    "seed",
    "presence_penalty",
    "frequency_penalty",
    "stream",
    "stream_options",
    "logit_bias",
    "user",
    "top_k",
    "min_p",
    "repetition_penalty",
    "ignore_eos",
    "min_tokens",
    "stop_token_ids",
    "skip_special_tokens",
    "include_stop_str_in_output",
    "max_tokens",
    "logprobs",
    "echo",
    "suffix",
    "best_of",
    "return_token_ids",
]
CHAT_FIELDS = [
    f
    for f in COMPLETION_FIELDS
    if f not in ("prompt", "echo", "suffix", "best_of", "logprobs", "return_token_ids")
] + [
    "messages",
    "max_completion_tokens",
    "logprobs",
    "top_logprobs",
    "response_format",
    "tools",
    "tool_choice",
    "add_generation_prompt",
]


def post(http: httpx.Client, server: ServerProcess, path: str, body: dict[str, Any]) -> httpx.Response:
    r = http.post(f"{server.base}{path}", content=dumps(body), headers={"Content-Type": "application/json"})
    if r.status_code == 200 and body.get("stream") is True:
        assert r.text.rstrip().endswith("data: [DONE]"), r.text[-200:]
        assert '"code":5' not in r.text, r.text[-300:]  # no in-band 5xx error either
    return r


@pytest.mark.slow
@pytest.mark.timeout(300)
@FUZZ
@given(
    field=st.sampled_from(COMPLETION_FIELDS),
    value=json_values,
    chat=st.booleans(),
    base_min=st.sampled_from([0, 1]),
)
def test_http_bodies(server: ServerProcess, field: str, value: Any, chat: bool, base_min: int) -> None:
    with httpx.Client(timeout=30) as http:
        if chat:
            body: dict[str, Any] = {
                "messages": [{"role": "user", "content": "hi"}],
                "max_tokens": 2,
                "min_tokens": base_min,
            }
            field = CHAT_FIELDS[COMPLETION_FIELDS.index(field) % len(CHAT_FIELDS)]
        else:
            body = {"prompt": "hi", "max_tokens": 2, "min_tokens": base_min}
        body[field] = value
        r = post(http, server, "/v1/chat/completions" if chat else "/v1/completions", body)
        assert r.status_code == 200 or 400 <= r.status_code < 500, (field, value, r.status_code, r.text[:300])
        if r.status_code != 200:
            err = r.json()["error"]
            assert err["code"] == r.status_code and err["message"]
        check_alive(server, http)


_ids = itertools.count()


def ws_roundtrip(ws: ClientConnection, frame: str, request_id: Any) -> list[dict[str, Any]]:
    """Sends one frame; the frames for it until its done or error frame (or one error without an id)."""
    ws.send(frame)
    got = []
    while True:
        msg = json.loads(ws.recv(timeout=30))
        got.append(msg)
        if msg["type"] in ("done", "error") and (msg.get("request_id") in (request_id, None)):
            return got


@pytest.mark.slow
@pytest.mark.timeout(300)
@FUZZ
@given(
    where=st.sampled_from(["params"] * 3 + ["frame"]),
    field=st.sampled_from(FIELDS + ["type", "request_id", "prompt", "prompt_token_ids", "params"]),
    value=json_values,
)
def test_websocket_frames(server: ServerProcess, where: str, field: str, value: Any) -> None:
    request_id = f"fz{next(_ids)}"
    frame: dict[str, Any] = {
        "type": "generate",
        "request_id": request_id,
        "prompt": "hi",
        "params": {"max_tokens": 2},
    }
    if where == "params" and field in FIELDS:
        frame["params"][field] = value
    else:
        if field in ("prompt_token_ids",):
            frame.pop("prompt")
        frame[field if field not in FIELDS else "params"] = value
    sent_id = frame.get("request_id")
    with connect(server.ws_url, open_timeout=10) as ws, httpx.Client(timeout=30) as http:
        frames = ws_roundtrip(ws, dumps(frame), sent_id if isinstance(sent_id, str) else None)
        last = frames[-1]
        if last["type"] == "error":
            assert 400 <= last["code"] < 500, (field, value, last)
        else:
            assert last["type"] == "done" and last["finish_reason"] in ("length", "stop"), last
        # the same connection still serves a good request
        good = ws_roundtrip(
            ws,
            json.dumps(
                {
                    "type": "generate",
                    "request_id": request_id + "-ok",
                    "prompt": "hi",
                    "params": {"max_tokens": 2, "temperature": 0},
                }
            ),
            request_id + "-ok",
        )
        assert good[-1]["type"] == "done", good
        check_alive(server, http)
