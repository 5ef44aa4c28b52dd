"""Host, Origin and Content-Type checks: what keeps web pages (and DNS-rebinding pages) from driving a
local server through the user's browser. In-process app over the fake engine of fake_engine.py."""

from __future__ import annotations

import pytest
from fake_engine import FakeEngine
from fastapi.testclient import TestClient
from starlette.testclient import WebSocketDenialResponse
from test_app import KEY

from asyncengine.entrypoints.guard import OriginPolicy
from asyncengine.entrypoints.server import build_app

pytestmark = pytest.mark.timeout(30)
LOCAL = {"Host": "127.0.0.1:8000"}
BODY = {"prompt": "x", "max_tokens": 2}


def client(policy: OriginPolicy, api_key: str | None = None) -> TestClient:
    return TestClient(
        build_app(FakeEngine(), api_key=api_key, policy=policy), base_url="http://127.0.0.1:8000"
    )


@pytest.mark.parametrize(
    "bind, host, ok",
    [
        ("127.0.0.1", "127.0.0.1:8000", True),
        ("127.0.0.1", "localhost:8000", True),
        ("127.0.0.1", "[::1]:8000", True),
        ("127.0.0.1", "LOCALHOST", True),
        ("127.0.0.1", "evil.example:8000", False),
        ("127.0.0.1", "", False),
        ("::1", "[::1]:8000", True),
        ("10.1.2.3", "10.1.2.3:80", True),
        ("10.1.2.3", "rebind.example", False),
        ("0.0.0.0", "anything.example", True),
    ],
)
def test_host_header_against_the_bind_address(bind: str, host: str, ok: bool) -> None:
    r = client(OriginPolicy.for_bind(bind)).get("/health", headers={"Host": host})
    assert (r.status_code == 200) == ok, r.text
    if not ok:
        assert r.status_code == 421 and "Host" in r.json()["error"]["message"]


def test_allowed_hosts_flag_replaces_the_default() -> None:
    c = client(OriginPolicy.for_bind("127.0.0.1", allowed_hosts=["llm.internal"]))
    assert c.get("/health", headers={"Host": "llm.internal:8000"}).status_code == 200
    assert c.get("/health", headers={"Host": "127.0.0.1:8000"}).status_code == 421
    c = client(OriginPolicy.for_bind("127.0.0.1", allowed_hosts=["*"]))
    assert c.get("/health", headers={"Host": "whatever.example"}).status_code == 200


def test_cross_origin_requests_are_refused_same_origin_and_non_browser_pass() -> None:
    c = client(OriginPolicy.for_bind("127.0.0.1"))
    assert c.post("/v1/completions", json=BODY, headers=LOCAL).status_code == 200  # no Origin: curl, SDKs
    same = {**LOCAL, "Origin": "http://127.0.0.1:8000"}
    assert c.post("/v1/completions", json=BODY, headers=same).status_code == 200
    for origin in ("http://evil.example", "http://127.0.0.1:9999", "null"):
        r = c.post("/v1/completions", json=BODY, headers={**LOCAL, "Origin": origin})
        assert r.status_code == 403 and "cross-origin" in r.json()["error"]["message"]


def test_cross_origin_websocket_handshakes_are_refused() -> None:
    c = client(OriginPolicy.for_bind("127.0.0.1"))
    with pytest.raises(WebSocketDenialResponse) as denied:
        with c.websocket_connect("/v1/ws", headers={**LOCAL, "Origin": "http://evil.example"}):
            pass
    assert denied.value.status_code == 403
    with c.websocket_connect("/v1/ws", headers={**LOCAL, "Origin": "http://127.0.0.1:8000"}) as ws:
        ws.send_json({"type": "generate", "request_id": "a", "prompt": "hi", "params": {"max_tokens": 2}})
        assert ws.receive_json()["type"] == "delta"


def test_allowed_origins_get_cors_answers() -> None:
    page = "http://app.example:3000"
    c = client(OriginPolicy.for_bind("127.0.0.1", allowed_origins=[page + "/"]), api_key=KEY)
    pre = c.options(
        "/v1/completions",
        headers={
            **LOCAL,
            "Origin": page,
            "Access-Control-Request-Method": "POST",
            "Access-Control-Request-Headers": "authorization,content-type",
        },
    )
    assert pre.status_code == 200 and pre.headers["access-control-allow-origin"] == page
    r = c.post(
        "/v1/completions", json=BODY, headers={**LOCAL, "Origin": page, "Authorization": f"Bearer {KEY}"}
    )
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == page
    r = c.post("/v1/completions", json=BODY, headers={**LOCAL, "Origin": page})
    assert r.status_code == 401  # CORS is no way around the key
    r = c.post("/v1/completions", json=BODY, headers={**LOCAL, "Origin": "http://other.example"})
    assert r.status_code == 403


@pytest.mark.parametrize(
    "content_type",
    [
        None,
        "text/plain",
        "application/x-www-form-urlencoded",
        "multipart/form-data; boundary=x",
        "application/jsonx",
    ],
)
def test_post_bodies_must_be_json(content_type: str | None) -> None:
    # a page's fetch with text/plain is a "simple request": no preflight, so only this check stops it
    c = client(OriginPolicy())
    headers = {"Content-Type": content_type} if content_type else {}
    r = c.post("/v1/completions", content=b'{"prompt": "x", "max_tokens": 2}', headers=headers)
    assert r.status_code == 415 and "application/json" in r.json()["error"]["message"]
    r = c.post(
        "/v1/completions",
        content=b'{"prompt": "x", "max_tokens": 2}',
        headers={"Content-Type": "application/json; charset=utf-8"},
    )
    assert r.status_code == 200


def test_models_list_keeps_the_model_path_private() -> None:
    r = client(OriginPolicy()).get("/v1/models")
    card = r.json()["data"][0]
    assert card["id"] == "fake-model" and "/models" not in r.text and card["root"] == "fake-model"


def test_flags_build_the_policy() -> None:
    from asyncengine.entrypoints.cli import build_parser

    args = build_parser().parse_args(
        [
            "serve",
            "--allowed-origins",
            "http://a.example:3000, http://b.example",
            "--allowed-hosts",
            "llm.internal",
        ]
    )
    policy = OriginPolicy.for_bind(args.host, args.allowed_hosts, args.allowed_origins)
    assert policy.allowed_origins == ("http://a.example:3000", "http://b.example")
    assert policy.allowed_hosts == ("llm.internal",)
    default = build_parser().parse_args(["serve"])
    assert OriginPolicy.for_bind(
        default.host, default.allowed_hosts, default.allowed_origins
    ).allowed_hosts == ("127.0.0.1", "localhost", "::1")


@pytest.mark.slow
def test_a_served_process_refuses_rebinding_and_cross_origin(server) -> None:
    import httpx
    from server_process import API_KEY
    from websockets.exceptions import InvalidStatus
    from websockets.sync.client import connect

    r = httpx.get(f"{server.base}/health", headers={"Host": "rebind.example"}, timeout=10)
    assert r.status_code == 421
    with pytest.raises(InvalidStatus) as refused:
        with connect(
            server.ws_url,
            origin="http://evil.example",
            open_timeout=10,
            additional_headers={"Authorization": f"Bearer {API_KEY}"},
        ):
            pass
    assert refused.value.response.status_code == 403
    r = httpx.post(
        f"{server.base}/v1/completions",
        content=b'{"prompt": "x"}',
        timeout=10,
        headers={"Authorization": f"Bearer {API_KEY}", "Content-Type": "text/plain"},
    )
    assert r.status_code == 415


def test_a_bodyless_post_needs_no_content_type() -> None:
    # vLLM's POST /ping carries no body; only a body must be JSON
    assert client(OriginPolicy()).post("/ping").status_code == 200


GEN = {"type": "generate", "request_id": "a", "prompt": "hi", "params": {"max_tokens": 2}}


def test_the_api_key_as_a_websocket_subprotocol() -> None:
    # a browser cannot set Authorization on a websocket: it offers the key as `asyncengine.bearer.KEY`
    c = client(OriginPolicy.for_bind("127.0.0.1"), api_key=KEY)
    # NOTE: a fresh headers dict per connection: the test client writes the subprotocols into the one given
    same = {**LOCAL, "Origin": "http://127.0.0.1:8000"}
    with c.websocket_connect(
        "/v1/ws", headers={**same}, subprotocols=["asyncengine", f"asyncengine.bearer.{KEY}"]
    ) as ws:
        assert ws.accepted_subprotocol == "asyncengine"  # never the one with the key
        ws.send_json(GEN)
        assert ws.receive_json()["type"] == "delta"
    for offered in (
        ["asyncengine", "asyncengine.bearer.wrong"],
        ["asyncengine", f"asyncengine.bearer.{KEY}x"],
        ["asyncengine", f"asyncengine.bearer{KEY}"],
        ["asyncengine", KEY],
        ["asyncengine"],
        [],
    ):
        with pytest.raises(WebSocketDenialResponse) as denied:
            with c.websocket_connect("/v1/ws", headers={**same}, subprotocols=offered):
                pass
        assert denied.value.status_code == 401, offered
    # the subprotocol is for websockets only, and never a way around the Origin check
    r = c.get("/v1/models", headers={**LOCAL, "Sec-WebSocket-Protocol": f"asyncengine.bearer.{KEY}"})
    assert r.status_code == 401
    with pytest.raises(WebSocketDenialResponse) as denied:
        with c.websocket_connect(
            "/v1/ws",
            headers={**LOCAL, "Origin": "http://evil.example"},
            subprotocols=["asyncengine", f"asyncengine.bearer.{KEY}"],
        ):
            pass
    assert denied.value.status_code == 403


def test_the_playground_page_needs_no_key_and_keeps_the_host_check() -> None:
    c = client(OriginPolicy.for_bind("127.0.0.1"), api_key=KEY)
    page = c.get("/", headers=LOCAL)
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    assert "/static/app.js" in page.text
    for name, kind in (("app.js", "javascript"), ("style.css", "text/css")):
        r = c.get(f"/static/{name}", headers=LOCAL)
        assert r.status_code == 200 and kind in r.headers["content-type"]
    assert c.get("/", headers={"Host": "rebind.example"}).status_code == 421
    assert c.get("/static/../guard.py", headers=LOCAL).status_code == 404


class ChatTokenizer:
    chat_template = "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}"

    def apply_chat_template(self, messages, add_generation_prompt, tokenize, **kwargs) -> str:  # noqa: ANN001
        if any(m["role"] == "bogus" for m in messages):
            raise ValueError("unknown role")
        text = "".join(f"<{m['role']}>{m['content']}" for m in messages)
        self.rendered = text + ("<assistant>" if add_generation_prompt else "")
        return self.rendered

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return list(text.encode())


def test_websocket_chat_frames() -> None:
    engine = FakeEngine(tokenizer=ChatTokenizer())
    c = TestClient(build_app(engine, policy=OriginPolicy()))
    chat = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    with c.websocket_connect("/v1/ws") as ws:
        ws.send_json({"type": "generate", "request_id": "c", "messages": chat, "params": {"max_tokens": 2}})
        frames = [ws.receive_json() for _ in range(3)]
        assert [f["type"] for f in frames] == ["delta", "delta", "done"]
        assert engine.tokenizer.rendered == "<system>be brief<user>hi<assistant>"
        ws.send_json(
            {"type": "generate", "request_id": "d", "messages": chat, "add_generation_prompt": False}
            | {"params": {"max_tokens": 1}}
        )
        assert [ws.receive_json()["type"] for _ in range(2)] == ["delta", "done"]
        assert engine.tokenizer.rendered == "<system>be brief<user>hi"
        bad = [
            ({"messages": []}, "non-empty list"),
            ({"messages": "hi"}, "non-empty list"),
            ({"messages": ["hi"]}, "messages[0]"),
            ({"messages": [{"role": "user"}]}, "messages[0]"),
            ({"messages": [{"role": "user", "content": "x", "contnet": "n"}]}, "the fields role and content"),
            ({"messages": [{"role": "user", "content": ["x"]}]}, "content must be a string"),
            ({"messages": [{"role": 1, "content": "x"}]}, "role must be"),
            ({"messages": chat, "add_generation_prompt": "yes"}, "add_generation_prompt"),
            ({"messages": chat, "prompt": "p"}, "exactly one of"),
            ({"prompt": "p", "add_generation_prompt": True}, "goes with messages"),
            ({"messages": [{"role": "bogus", "content": "x"}]}, "chat template"),
        ]
        for fields, expect in bad:
            ws.send_json({"type": "generate", "request_id": "e", **fields})
            msg = ws.receive_json()
            assert msg["type"] == "error" and msg["code"] == 400 and expect in msg["message"], (fields, msg)
            assert msg["request_id"] == "e"
