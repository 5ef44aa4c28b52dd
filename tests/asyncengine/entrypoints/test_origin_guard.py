"""Host, Origin and Content-Type checks: what keeps web pages (and DNS-rebinding pages) from driving a
local server through the user's browser. In-process app over the fake engine of test_app."""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient
from starlette.testclient import WebSocketDenialResponse
from test_app import KEY, FakeEngine

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
