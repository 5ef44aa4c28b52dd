"""AsyncClient against the real server, and against a scripted websocket server for reconnection."""

from __future__ import annotations

import asyncio
import contextlib
import json

import openai
import pytest
from server_process import ABORTS, API_KEY, ServerProcess, free_port, metric, wait_aborted
from websockets.asyncio.server import serve

from asyncengine.client import (
    AsyncClient,
    AuthenticationError,
    BadRequestError,
    ClientConnectionError,
    ConnectionLost,
    Delta,
    RateLimitError,
    ServerError,
    Usage,
)

pytestmark = pytest.mark.timeout(60)


@pytest.mark.slow
async def test_complete_matches_openai_http(server: ServerProcess) -> None:
    http = openai.AsyncOpenAI(base_url=f"{server.base}/v1", api_key=API_KEY, max_retries=0)
    want = await http.completions.create(
        model="", prompt="hello there", max_tokens=10, temperature=0, extra_body={"ignore_eos": True}
    )
    async with AsyncClient(server.ws_url, api_key=API_KEY) as client:
        got = await client.complete("hello there", max_tokens=10, temperature=0.0, ignore_eos=True)
        assert got.text == want.choices[0].text and len(got.token_ids) == 10
        assert got.finish_reason == "length" and got.usage == Usage(want.usage.prompt_tokens, 10)
        deltas = [
            d
            async for d in client.generate(
                [1, 2, 3], max_tokens=3, temperature=0.0, ignore_eos=True, logprobs=1
            )
        ]
    assert all(isinstance(d, Delta) for d in deltas) and deltas[-1].finish_reason == "length"
    assert deltas[-1].usage == Usage(3, 3) and all(d.logprobs for d in deltas[:-1] if d.token_ids)


@pytest.mark.slow
async def test_concurrent_generates_and_cancel_by_leaving(server: ServerProcess) -> None:
    async with AsyncClient(server.ws_url, api_key=API_KEY) as client:
        results = await asyncio.gather(
            *(client.complete(f"p{i}", max_tokens=5, ignore_eos=True) for i in range(20))
        )
        assert all(r.usage.completion_tokens == 5 for r in results)
        aborts = metric(server, ABORTS)
        stream = client.generate("long", max_tokens=1000, ignore_eos=True)
        async with contextlib.aclosing(stream):
            async for delta in stream:
                if delta.token_ids:
                    break  # leaving the loop cancels the request on the server
        await asyncio.to_thread(wait_aborted, server, aborts)
        again = await client.complete("after", max_tokens=2)
        assert again.finish_reason in ("stop", "length")


@pytest.mark.slow
async def test_typed_errors(server: ServerProcess) -> None:
    async with AsyncClient(server.ws_url, api_key=API_KEY) as client:
        with pytest.raises(BadRequestError) as bad:
            await client.complete("x", max_tokens=0)
        assert bad.value.code == 400 and "max_tokens" in bad.value.message
        with pytest.raises(BadRequestError):
            await client.complete("x", bogus_param=1)
        assert (await client.complete("x", max_tokens=1)).usage.completion_tokens == 1
    with pytest.raises(AuthenticationError) as denied:
        await AsyncClient(server.ws_url, api_key="wrong").connect()
    assert denied.value.code == 401 and isinstance(denied.value, ServerError)
    with pytest.raises(ClientConnectionError):
        await AsyncClient(f"ws://127.0.0.1:{free_port()}/v1/ws").connect()


async def test_connection_lost_then_reconnect() -> None:
    """A scripted server: the first connection drops mid-stream, the next one answers normally."""
    connections = 0

    async def handler(ws) -> None:
        nonlocal connections
        connections += 1
        async for raw in ws:
            frame = json.loads(raw)
            rid = frame["request_id"]
            await ws.send(json.dumps({"type": "delta", "request_id": rid, "text": "a", "token_ids": [1]}))
            if connections == 1:
                ws.transport.abort()  # a dropped TCP connection, no close frame
                return
            if frame["prompt"] == "busy":
                await ws.send(
                    json.dumps({"type": "error", "request_id": rid, "code": 429, "message": "busy"})
                )
                continue
            await ws.send(
                json.dumps(
                    {
                        "type": "done",
                        "request_id": rid,
                        "finish_reason": "stop",
                        "usage": {"prompt_tokens": 1, "completion_tokens": 1},
                    }
                )
            )

    async with serve(handler, "127.0.0.1", 0) as ws_server:
        port = ws_server.sockets[0].getsockname()[1]
        async with AsyncClient(f"ws://127.0.0.1:{port}") as client:
            got = []
            with pytest.raises(ConnectionLost):
                async for delta in client.generate("p"):
                    got.append(delta.text)
            assert got == ["a"]
            done = await client.complete("p")
            assert (done.text, done.finish_reason, done.usage) == ("a", "stop", Usage(1, 1))
            with pytest.raises(RateLimitError):
                await client.complete("busy")
    assert connections == 2
