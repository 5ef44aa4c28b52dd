"""`asyncengine serve` as a real subprocess, driven by the openai SDK, httpx and the websockets package."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable

import httpx
import openai
import pytest
from server_process import ABORTS, API_KEY, LENGTHS, NUM_KV_BLOCKS, ServerProcess, metric, wait_aborted
from websockets.asyncio.client import connect
from websockets.exceptions import ConnectionClosed, InvalidStatus

from asyncengine import SamplingParams

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]
AUTH = {"Authorization": f"Bearer {API_KEY}"}
PROMPTS = ["hello world", "def fibonacci(n):"]


def sdk(server: ServerProcess, key: str = API_KEY) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base}/v1", api_key=key, max_retries=0, timeout=60)


def ws_connect(server: ServerProcess, **kw):
    return connect(server.ws_url, additional_headers=AUTH, open_timeout=20, **kw)


def test_health_models_metrics(server: ServerProcess) -> None:
    assert httpx.get(f"{server.base}/health").json() == {"status": "ok"}
    models = sdk(server).models.list().data
    assert [m.id for m in models] == [server.stdout_lines[-1].split()[2]] and models[0].object == "model"
    assert metric(server, "kv_cache_free_blocks") == NUM_KV_BLOCKS
    assert httpx.get(f"{server.base}/v1/models").status_code == 401


def test_openai_sdk_greedy_matches_in_process_llm(server: ServerProcess, llm_factory, chat_model) -> None:
    llm = llm_factory(chat_model)
    greedy = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    client, model = sdk(server), server.stdout_lines[-1].split()[2]
    extra = {"ignore_eos": True}
    for prompt in PROMPTS:
        want = llm.generate(prompt, greedy)[0].outputs[0].text
        full = client.completions.create(
            model=model, prompt=prompt, max_tokens=8, temperature=0, extra_body=extra
        )
        assert full.object == "text_completion" and full.id.startswith("cmpl-") and full.model == model
        assert full.choices[0].text == want and full.choices[0].finish_reason == "length"
        assert full.usage.completion_tokens == 8
        stream = client.completions.create(
            model=model, prompt=prompt, max_tokens=8, temperature=0, stream=True, extra_body=extra
        )
        assert "".join(c.choices[0].text for c in stream if c.choices) == want
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi there"}]
    text = llm.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    want = llm.generate(llm.tokenizer.encode(text, add_special_tokens=False), greedy)[0].outputs[0].text
    chat = client.chat.completions.create(
        model=model, messages=messages, max_completion_tokens=8, temperature=0, extra_body=extra
    )
    assert chat.object == "chat.completion" and chat.id.startswith("chatcmpl-")
    assert chat.choices[0].message.content == want and chat.choices[0].message.role == "assistant"
    chunks = list(
        client.chat.completions.create(
            model=model, messages=messages, max_tokens=8, temperature=0, stream=True, extra_body=extra
        )
    )
    assert {c.object for c in chunks} == {"chat.completion.chunk"}
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == want


def test_openai_sdk_n_usage_logprobs_seed(server: ServerProcess) -> None:
    client, model = sdk(server), server.stdout_lines[-1].split()[2]
    chunks = list(
        client.completions.create(
            model=model,
            prompt="hello",
            max_tokens=5,
            n=2,
            stream=True,
            logprobs=2,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
    )
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 10
    for index in (0, 1):
        mine = [c.choices[0] for c in chunks if c.choices and c.choices[0].index == index]
        assert [c.finish_reason for c in mine][-1] == "length"
        tokens = [t for c in mine for t in c.logprobs.tokens]
        assert len(tokens) == 5
        for c in mine:  # top-2 keyed by token text (texts like '\ufffd' may collide), offsets grow
            assert len(c.logprobs.top_logprobs) == len(c.logprobs.text_offset) == len(c.logprobs.tokens)
            assert all(1 <= len(top) <= 3 for top in c.logprobs.top_logprobs)
    chat = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=4,
        logprobs=True,
        top_logprobs=3,
        seed=7,
        extra_body={"ignore_eos": True},
    )
    content = chat.choices[0].logprobs.content
    assert len(content) == 4 and all(len(t.top_logprobs) == 3 for t in content)
    assert all(t.top_logprobs[0].logprob >= t.top_logprobs[1].logprob for t in content)
    again = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=4,
        seed=7,
        extra_body={"ignore_eos": True},
    )
    assert again.choices[0].message.content == chat.choices[0].message.content  # same seed, same sample
    stopped = client.completions.create(
        model=model,
        prompt=[1, 2, 3],
        max_tokens=30,
        temperature=0,
        extra_body={"ignore_eos": True, "min_tokens": 2},
    )
    assert stopped.usage.prompt_tokens == 3 and stopped.usage.completion_tokens == 30


def test_openai_sdk_typed_errors_then_success(server: ServerProcess) -> None:
    client, model = sdk(server), server.stdout_lines[-1].split()[2]
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=model, prompt="x", max_tokens=-1)
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=model, prompt="x", temperature=-3)
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=model, prompt="x" * 5000, max_tokens=2)  # over max_model_len
    with pytest.raises(openai.BadRequestError, match="invalid request"):
        client.chat.completions.create(model=model, messages=[{"content": "no role"}])
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="not-this-one", prompt="x")
    with pytest.raises(openai.AuthenticationError):
        sdk(server, key="wrong").completions.create(model=model, prompt="x")
    r = httpx.post(f"{server.base}/v1/completions", headers=AUTH, content=b"{" + b" " * 300_000 + b"}")
    assert r.status_code == 413 and r.json()["error"]["code"] == 413
    ok = client.completions.create(model=model, prompt="x", max_tokens=2)
    assert ok.choices[0].finish_reason in ("stop", "length")


async def test_websocket_protocol(server: ServerProcess) -> None:
    async with ws_connect(server, max_size=2**22) as ws:
        await ws.send(
            json.dumps(
                {
                    "type": "generate",
                    "request_id": "r1",
                    "prompt_token_ids": [5, 6, 7],
                    "params": {"max_tokens": 6, "temperature": 0, "ignore_eos": True, "logprobs": 1},
                }
            )
        )
        await ws.send("not json")
        await ws.send(
            json.dumps({"type": "generate", "request_id": "r2", "prompt": "x", "params": {"temperature": -1}})
        )
        await ws.send(json.dumps({"type": "generate", "request_id": "r3", "prompt_token_ids": [10**9]}))
        await ws.send(json.dumps({"type": "cancel", "request_id": "nobody"}))
        await ws.send(json.dumps({"type": "generate", "request_id": "big", "prompt": "x" * 70_000}))
        frames, done = [], None
        while done is None or len([f for f in frames if f["type"] == "error"]) < 5:
            frame = json.loads(await asyncio.wait_for(ws.recv(), 30))
            frames.append(frame)
            done = frame if frame["type"] == "done" else done
        errors = sorted((f["request_id"] or "", f["code"]) for f in frames if f["type"] == "error")
        assert errors == [
            ("", 400),
            ("", 413),
            ("nobody", 400),
            ("r2", 400),
            ("r3", 400),
        ]  # oversize: unparsed
        deltas = [f for f in frames if f["type"] == "delta"]
        assert sum(len(d["token_ids"]) for d in deltas) == 6 and all("logprobs" in d for d in deltas)
        assert (
            done["usage"] == {"prompt_tokens": 3, "completion_tokens": 6}
            and done["finish_reason"] == "length"
        )
        await ws.send("x" * 200_000)  # over twice the frame limit: the transport closes with 1009
        with pytest.raises(ConnectionClosed) as closed:
            await asyncio.wait_for(ws.recv(), 30)
        assert closed.value.rcvd is not None and closed.value.rcvd.code == 1009
    with pytest.raises(InvalidStatus) as denied:
        async with connect(server.ws_url, open_timeout=20):
            pass
    assert denied.value.response.status_code == 401


async def _generate(ws, request_id: str, max_tokens: int = 4) -> None:
    await ws.send(
        json.dumps(
            {
                "type": "generate",
                "request_id": request_id,
                "prompt": f"n{request_id}",
                "params": {"max_tokens": max_tokens, "ignore_eos": True},
            }
        )
    )


async def test_100_streams_on_one_connection(server: ServerProcess) -> None:
    async with ws_connect(server) as ws:
        for i in range(100):
            await _generate(ws, str(i))
        tokens: dict[str, int] = {}
        done: dict[str, dict] = {}
        while len(done) < 100:
            frame = json.loads(await asyncio.wait_for(ws.recv(), 60))
            assert frame["type"] in ("delta", "done"), frame
            if frame["type"] == "delta":
                tokens[frame["request_id"]] = tokens.get(frame["request_id"], 0) + len(frame["token_ids"])
            else:
                done[frame["request_id"]] = frame
    assert all(tokens[str(i)] == 4 and done[str(i)]["finish_reason"] == "length" for i in range(100))


async def test_100_connections(server: ServerProcess) -> None:
    async def one(i: int) -> dict:
        async with ws_connect(server) as ws:
            await _generate(ws, "r")
            while (frame := json.loads(await ws.recv()))["type"] == "delta":
                pass
            return frame

    frames = await asyncio.wait_for(asyncio.gather(*(one(i) for i in range(100))), 90)
    assert all(f["type"] == "done" and f["usage"]["completion_tokens"] == 4 for f in frames)


async def test_cancel_and_disconnect_free_kv_blocks(server: ServerProcess) -> None:
    long = {"max_tokens": 1000, "ignore_eos": True}  # far longer than any of the waits below
    aborts = metric(server, ABORTS)
    async with ws_connect(server) as ws:
        await cancel_a_running_request(server, ws, long)
    aborts = await asyncio.to_thread(wait_aborted, server, aborts)

    async def close_the_socket(attempt: int) -> None:
        async with ws_connect(server) as ws:
            request = {"type": "generate", "request_id": f"gone-{attempt}", "prompt": "close", "params": long}
            await ws.send(json.dumps(request))
            await ws.recv()

    aborts = await hang_up_until_aborted(server, close_the_socket, aborts)

    async def drop_the_stream(attempt: int) -> None:
        async with httpx.AsyncClient(base_url=server.base, headers=AUTH, timeout=30) as http:
            async with http.stream(
                "POST", "/v1/completions", json={"prompt": f"sse {attempt}", "stream": True, **long}
            ) as r:
                async for line in r.aiter_lines():
                    if line.startswith("data:"):
                        break  # leaving the block drops the connection mid-stream

    aborts = await hang_up_until_aborted(server, drop_the_stream, aborts)

    async def give_up(attempt: int) -> None:
        await give_up_on_a_running_request(server, {"prompt": f"slow {attempt}", **long})

    await hang_up_until_aborted(server, give_up, aborts)


async def hang_up_until_aborted(
    server: ServerProcess, hang_up: Callable[[int], Awaitable[None]], aborts: float
) -> float:
    """Runs `hang_up(attempt)`, a request whose client goes away once the server runs it, until the server
    aborts one, then waits until every KV block is free again; returns the abort count. The tiny model
    makes its ~1,000 tokens in well under a second on a fast CPU, so on a loaded machine a request can finish
    before the server sees its client gone (seen in CI, 2026-12-07, for a non-streaming request): such an
    attempt ends with 'length', aborts nothing, and is tried again."""
    for attempt in range(5):
        lengths = await asyncio.to_thread(metric, server, LENGTHS)
        await hang_up(attempt)
        deadline = asyncio.get_running_loop().time() + 20
        while True:
            if await asyncio.to_thread(metric, server, ABORTS) > aborts:
                return await asyncio.to_thread(wait_aborted, server, aborts)
            if await asyncio.to_thread(metric, server, LENGTHS) > lengths:
                break  # it finished first
            assert asyncio.get_running_loop().time() < deadline, "neither aborted nor finished"
            await asyncio.sleep(0.05)
    pytest.fail("every request finished before the server saw its client go")


async def cancel_a_running_request(server: ServerProcess, ws, params: dict) -> None:
    """Sends "cancel" for a request the server is running: its stream ends with finish_reason "abort". The
    deltas wait in the socket's buffers, so on a loaded machine the tiny model can finish all its tokens
    (max_model_len caps them at ~1000) before the client has read one delta and sent the cancel (seen in
    CI, 2026-12-07). Such an attempt cancelled nothing (the server answers the late cancel with an error
    frame) and is tried again; one that ends in "abort" must have held KV blocks when its first delta
    was read."""
    for attempt in range(5):
        rid = f"cancel-{attempt}"
        await ws.send(
            json.dumps({"type": "generate", "request_id": rid, "prompt": "cancel me", "params": params})
        )
        assert json.loads(await ws.recv())["type"] == "delta"
        held = metric(server, "kv_cache_free_blocks") < NUM_KV_BLOCKS
        await ws.send(json.dumps({"type": "cancel", "request_id": rid}))
        while (frame := json.loads(await asyncio.wait_for(ws.recv(), 30)))["type"] == "delta":
            pass
        assert frame["type"] == "done" and frame["request_id"] == rid
        if frame["finish_reason"] == "abort":
            assert held
            return
        assert frame["finish_reason"] == "length"  # it finished before the cancel reached it
        late = json.loads(await asyncio.wait_for(ws.recv(), 30))
        assert late["type"] == "error" and late["request_id"] == rid, late
    pytest.fail("every request finished before its cancel reached the server")


async def give_up_on_a_running_request(server: ServerProcess, payload: dict) -> None:
    """A non-streaming /v1/completions request whose client hangs up once the server is running it (its KV
    blocks taken). Not a client read timeout: that raced the generation, and a fast CPU finished 1000
    tokens of the tiny model inside the 0.5 s it allowed (seen on an AMD EPYC, 2026-12-06)."""

    def free() -> float:
        return metric(server, "kv_cache_free_blocks")

    deadline = asyncio.get_running_loop().time() + 30
    while await asyncio.to_thread(free) < NUM_KV_BLOCKS:  # the aborts before this one have freed theirs
        assert asyncio.get_running_loop().time() < deadline
        await asyncio.sleep(0.01)
    body = json.dumps(payload).encode()
    _, writer = await asyncio.open_connection("127.0.0.1", server.port)
    head = (
        f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {API_KEY}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
    )
    writer.write(head.encode() + body)
    await writer.drain()
    while await asyncio.to_thread(free) == NUM_KV_BLOCKS:
        assert asyncio.get_running_loop().time() < deadline
        await asyncio.sleep(0.005)
    writer.close()
    await writer.wait_closed()
