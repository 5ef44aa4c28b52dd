"""The ASGI app in-process, over a fake engine: HTTP errors, limits, auth, health states, websocket protocol.

No processes and no model: these pin the serving layer's own behaviour in well under a second each.
"""

from __future__ import annotations

import json
import time
from types import SimpleNamespace
from typing import Any

import pytest
from fake_engine import FakeEngine
from fastapi.testclient import TestClient
from starlette.testclient import WebSocketDenialResponse

from asyncengine.entrypoints.server import build_app
from asyncengine.entrypoints.server_state import ServerLimits
from asyncengine.errors import EngineDeadError
from asyncengine.outputs import CompletionOutput, RequestOutput
from asyncengine.sampling_params import SamplingParams

pytestmark = pytest.mark.timeout(30)
KEY = "sk-app"


def client(engine: Any = None, **limits: int) -> TestClient:
    app = build_app(engine, api_key=KEY, limits=ServerLimits(**limits))
    return TestClient(app, headers={"Authorization": f"Bearer {KEY}"})


def test_health_follows_engine_state() -> None:
    c = client()
    assert c.get("/health").status_code == 503 and c.get("/health").json()["status"] == "loading"
    assert c.get("/v1/models").status_code == 503
    engine = FakeEngine()
    c.app.state.server.attach(engine)
    assert c.get("/health").status_code == 200
    assert c.get("/v1/models").json()["data"][0]["id"] == "fake-model"
    engine.dead = EngineDeadError("worker 0 died")
    r = c.post("/v1/completions", json={"prompt": "hi"})
    assert r.status_code == 503 and r.json()["error"]["code"] == 503
    assert c.get("/health").json()["status"] == "dead"


def test_auth() -> None:
    c = client(FakeEngine())
    for headers in ({"Authorization": ""}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}):
        r = c.get("/v1/models", headers=headers)
        assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
    assert c.get("/health", headers={"Authorization": ""}).status_code == 200
    with pytest.raises(WebSocketDenialResponse) as denied:
        with c.websocket_connect("/v1/ws", headers={"Authorization": "Bearer wrong"}):
            pass
    assert denied.value.status_code == 401


@pytest.mark.parametrize(
    "body, words",
    [
        ("{}", "prompt"),
        ('{"prompt": "x", "temperature": "hot"}', "temperature"),
        ('{"prompt": "x", "max_tokens": 0}', "max_tokens"),
        ('{"prompt": "x", "echo": true}', "echo"),
        ('{"prompt": "x", "stream_options": {"include_usage": true}}', "stream"),
        ("{not json", "JSON"),
        ('{"prompt": "bad"}', "bad prompt"),
        ('{"prompt": "x", "model": "other"}', "does not exist"),
        # strict types, as OpenAI's, and ranges that name the field (ints past 64 bits killed the engine)
        ('{"prompt": "x", "max_tokens": "4"}', "max_tokens"),
        ('{"prompt": "x", "max_tokens": true}', "max_tokens"),
        ('{"prompt": "x", "n": 2.0}', "n"),
        ('{"prompt": "x", "top_k": 1180591620717411303424}', "top_k"),
        ('{"prompt": "x", "min_tokens": 18446744073709551616, "max_tokens": null}', "min_tokens"),
        ('{"prompt": "x", "stop_token_ids": [18446744073709551616], "min_tokens": 1}', "stop_token_ids"),
        ('{"prompt": "x", "seed": 9223372036854775808}', "seed"),
        ('{"prompt": "x", "logprobs": 1e400}', "logprobs"),
        ('{"prompt": "x", "temperature": 1e400}', "temperature"),
    ],
)
def test_bad_requests_get_openai_errors(body: str, words: str) -> None:
    r = client(FakeEngine()).post(
        "/v1/completions", content=body, headers={"Content-Type": "application/json"}
    )
    assert r.status_code in (400, 404), r.text
    err = r.json()["error"]
    assert words in err["message"] and err["code"] == r.status_code and err["type"]


def test_body_limit_and_unknown_route() -> None:
    c = client(FakeEngine(), max_body_bytes=1000)
    r = c.post("/v1/completions", json={"prompt": "x" * 2000})
    assert r.status_code == 413 and "1000" in r.json()["error"]["message"]
    chunked = iter([b'{"prompt": "', b"x" * 800, b"x" * 800, b'"}'])  # no content-length: counted as read
    r = c.post("/v1/completions", content=chunked, headers={"Content-Type": "application/json"})
    assert r.status_code == 413 and r.json()["error"]["code"] == 413
    assert c.get("/v1/nothing").json()["error"]["code"] == 404


def test_a_constraint_over_the_size_cap_is_a_400_naming_it() -> None:
    """Under the body limit, over structured output's size cap: refused before anything compiles."""
    schema = {"type": "object", "properties": {f"p{i}": {"type": "integer"} for i in range(30000)}}
    r = client(FakeEngine()).post("/v1/completions", json={"prompt": "x", "guided_json": schema})
    err = r.json()["error"]
    assert r.status_code == 400 and err["param"] == "guided_json" and "too large" in err["message"], err


def test_chat_needs_a_chat_template() -> None:
    body = {"messages": [{"role": "user", "content": "hi"}]}
    assert (
        "no tokenizer"
        in client(FakeEngine()).post("/v1/chat/completions", json=body).json()["error"]["message"]
    )
    tok = SimpleNamespace(chat_template=None)
    r = client(FakeEngine(tokenizer=tok)).post("/v1/chat/completions", json=body)
    assert r.status_code == 400 and "chat template" in r.json()["error"]["message"]


def test_completions_batch_n_and_stream() -> None:
    c = client(FakeEngine())
    resp = c.post("/v1/completions", json={"prompt": [[1, 2], [3]], "max_tokens": 2, "n": 1, "stream": False})
    assert resp.headers["content-type"] == "application/json"  # stream=false never streams
    r = resp.json()
    assert r["object"] == "text_completion" and [ch["index"] for ch in r["choices"]] == [0, 1]
    assert r["choices"][0]["text"] == "t0 t1 " and r["usage"]["completion_tokens"] == 4
    with c.stream(
        "POST",
        "/v1/completions",
        json={"prompt": "x", "max_tokens": 3, "stream": True, "stream_options": {"include_usage": True}},
    ) as s:
        lines = [line for line in s.iter_lines() if line]
    assert lines[-1] == "data: [DONE]"
    chunks = [json.loads(line[6:]) for line in lines[:-1]]
    assert "".join(ch["choices"][0]["text"] for ch in chunks[:-1]) == "t0 t1 t2 "
    assert chunks[-2]["choices"][0]["finish_reason"] == "length"
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["total_tokens"] == 5


class NoTextEngine(FakeEngine):
    """A model without a tokenizer: token ids, empty text."""

    async def generate(self, prompt: Any, params: SamplingParams, request_id: str):
        async for out in super().generate(prompt, params, request_id):
            yield RequestOutput(
                out.request_id,
                None,
                out.prompt_token_ids,
                [
                    CompletionOutput(c.index, "", c.token_ids, None, None, c.finish_reason)
                    for c in out.outputs
                ],
                out.finished,
            )


def test_completions_return_token_ids() -> None:
    """vLLM's return_token_ids: ids on every choice and chunk, the prompt's in a full response; a model
    without a tokenizer then streams its tokens as they come (without it, only the final chunk)."""
    c = client(NoTextEngine())
    r = c.post("/v1/completions", json={"prompt": [1, 2], "max_tokens": 3, "return_token_ids": True}).json()
    choice = r["choices"][0]
    assert choice["text"] == "" and choice["token_ids"] == [0, 1, 2] and choice["prompt_token_ids"] == [7, 7]
    plain = c.post("/v1/completions", json={"prompt": [1, 2], "max_tokens": 3}).json()["choices"][0]
    assert plain["token_ids"] is None and plain["prompt_token_ids"] is None

    def stream(extra: dict[str, Any]) -> list[dict[str, Any]]:
        with c.stream(
            "POST", "/v1/completions", json={"prompt": [1], "max_tokens": 4, "stream": True, **extra}
        ) as s:
            lines = [line for line in s.iter_lines() if line]
        assert lines[-1] == "data: [DONE]"
        return [json.loads(line[6:]) for line in lines[:-1]]

    chunks = stream({"return_token_ids": True})
    assert [ch["choices"][0]["token_ids"] for ch in chunks] == [[0], [1], [2], [3]]
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert len(stream({})) == 1  # empty text and no ids asked for: nothing to send until the end


def test_websocket_protocol_errors_keep_the_connection() -> None:
    c = client(FakeEngine(), max_frame_bytes=1000)
    with c.websocket_connect("/v1/ws") as ws:
        bad = [
            "{nope",
            "[1]",
            json.dumps({"type": "generate"}),
            json.dumps({"type": "x", "request_id": "a"}),
            json.dumps({"type": "cancel", "request_id": "ghost"}),
            json.dumps({"type": "generate", "request_id": "a"}),
            json.dumps({"type": "generate", "request_id": "a", "prompt": "p", "prompt_token_ids": [1]}),
            json.dumps({"type": "generate", "request_id": "a", "prompt": "p", "params": {"n": 2}}),
            json.dumps({"type": "generate", "request_id": "a", "prompt": "p", "params": {"bogus": 1}}),
            json.dumps({"type": "generate", "request_id": "a", "prompt": "p", "params": []}),
            json.dumps({"type": "generate", "request_id": "a", "prompt": "bad"}),
            "x" * 1001,
        ]
        for frame in bad:
            ws.send_text(frame)
            msg = ws.receive_json()
            assert msg["type"] == "error" and msg["code"] in (400, 413), (frame, msg)
        assert msg["code"] == 413
        ws.send_bytes(b"\x00")
        assert ws.receive_json()["code"] == 400
        ws.send_json({"type": "generate", "request_id": "ok", "prompt": "p", "params": {"max_tokens": 3}})
        frames = [ws.receive_json() for _ in range(4)]
    assert [f["type"] for f in frames] == ["delta"] * 3 + ["done"]
    assert frames[-1] == {
        "type": "done",
        "request_id": "ok",
        "finish_reason": "length",
        "usage": {"prompt_tokens": 2, "completion_tokens": 3},
    }


def test_websocket_cancel_duplicate_and_limits() -> None:
    engine = FakeEngine(delay=0.05)
    c = client(engine, max_live_per_connection=2, max_live_requests=3)
    slow = {"max_tokens": 1000}
    with c.websocket_connect("/v1/ws") as ws, c.websocket_connect("/v1/ws") as ws2:
        for rid in ("a", "b", "c"):
            ws.send_json({"type": "generate", "request_id": rid, "prompt": "p", "params": slow})
        assert ws.receive_json() == {
            "type": "error",
            "request_id": "c",
            "code": 429,
            "message": "this connection has 2 live requests (limit 2)",
        }
        ws.send_json({"type": "generate", "request_id": "a", "prompt": "p"})
        assert (ws.receive_json() | {"message": ""}) == {
            "type": "error",
            "request_id": "a",
            "code": 400,
            "message": "",
        }
        ws2.send_json({"type": "generate", "request_id": "x", "prompt": "p", "params": slow})
        r = c.post("/v1/completions", json={"prompt": "p"})  # the 4th live request, over the global 3
        assert r.status_code == 429 and r.json()["error"]["type"] == "rate_limit_error"
        ws.send_json({"type": "cancel", "request_id": "a"})
        while (msg := ws.receive_json())["type"] != "done":
            assert msg["type"] == "delta"
        assert msg["request_id"] == "a" and msg["finish_reason"] == "abort"
    # closing the connections aborted what was left
    for _ in range(100):
        if not engine.live:
            break
        time.sleep(0.02)
    assert not engine.live and c.app.state.server.live == 0
