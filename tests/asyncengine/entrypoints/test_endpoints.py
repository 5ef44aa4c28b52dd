"""The API surface in-process, over a fake engine: unknown fields refused by name, every field of OpenAI's
SDK known, `param` in error bodies, vLLM's small endpoints (/tokenize, /detokenize, /version, /ping,
/v1/models/{id}), /docs and /openapi.json, and /metrics labelled with the model name.
"""

from __future__ import annotations

import json
import typing
from pathlib import Path
from typing import Any

import openai
import pytest
import transformers
from fake_engine import FakeEngine
from fastapi.testclient import TestClient
from openai.types import completion_create_params
from openai.types.chat import (
    chat_completion_content_part_param,
    chat_completion_content_part_refusal_param,
    chat_completion_message_param,
    chat_completion_stream_options_param,
)
from openai.types.chat import (
    completion_create_params as chat_create_params,
)
from test_app import KEY, client
from tiny_models import build_tokenizer

from asyncengine.entrypoints.chat_protocol import ChatMessage, ContentPart
from asyncengine.entrypoints.guard import OriginPolicy
from asyncengine.entrypoints.openai_protocol import ChatCompletionRequest, CompletionRequest, StreamOptions
from asyncengine.entrypoints.server import build_app
from asyncengine.entrypoints.server_state import ServerLimits
from asyncengine.stats import EngineStats

pytestmark = pytest.mark.timeout(60)
HI = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Any:
    path: Path = build_tokenizer(tmp_path_factory.mktemp("tokenizer"))
    return transformers.AutoTokenizer.from_pretrained(path)


class RecordingEngine(FakeEngine):
    """FakeEngine that keeps the prompts it was given."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.prompts: list[Any] = []

    async def generate(self, prompt: Any, params: Any, request_id: str):
        self.prompts.append(prompt)
        async for out in super().generate(prompt, params, request_id):
            yield out


def error(r: Any, status: int = 400) -> dict[str, Any]:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["code"] == status
    return err


# -- request fields ---------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "path, body, param, words",
    [
        ("/v1/completions", {"prompt": "x", "max_token": 3}, "max_token", "did you mean max_tokens"),
        ("/v1/completions", {"prompt": "x", "temprature": 0.5}, "temprature", "did you mean temperature"),
        ("/v1/completions", {"prompt": "x", "bogus_param": 1}, "bogus_param", "unrecognized"),
        (
            "/v1/chat/completions",
            {"messages": HI, "max_completion_token": 3},
            "max_completion_token",
            "did you mean max_completion_tokens",
        ),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "hi", "contnet": "x"}]},
            "messages",
            "messages.0.contnet: unrecognized",
        ),
        (
            "/v1/chat/completions",
            {"messages": HI, "stream": True, "stream_options": {"include_usag": True}},
            "stream_options",
            "stream_options.include_usag",
        ),
    ],
)
def test_unknown_fields_are_refused_by_name(path: str, body: dict[str, Any], param: str, words: str) -> None:
    err = error(client(FakeEngine()).post(path, json=body))
    assert err["param"] == param and words in err["message"], err


@pytest.mark.parametrize(
    "body, param",
    [
        ({"prompt": "x", "temperature": -1}, "temperature"),  # SamplingParams' own range check
        ({"prompt": "x", "top_p": 0}, "top_p"),
        ({"prompt": "x", "max_tokens": "4"}, "max_tokens"),  # a type error (pydantic's)
        ({"prompt": "x", "stop_token_ids": [-1]}, "stop_token_ids"),
        ({"prompt": "x", "min_tokens": 5, "max_tokens": 2}, "min_tokens"),
        ({"prompt": "x", "echo": True}, "echo"),
        ({"prompt": "x", "logit_bias": {"5": 1}}, "logit_bias"),
        ({"prompt": "x", "use_beam_search": True}, "use_beam_search"),
        ({"prompt": "x", "model": "other"}, "model"),
        ({"prompt": [[1]] * 300}, "prompt"),
        ({"prompt": "x", "n": 2, "best_of": 3}, "best_of"),
        ("{not json", None),
        ({"prompt": "x", "stream_options": {"include_usage": True}}, "stream_options"),
    ],
)
def test_errors_name_their_param(body: dict[str, Any] | str, param: str | None) -> None:
    content = body if isinstance(body, str) else json.dumps(body)
    r = client(FakeEngine()).post(
        "/v1/completions", content=content, headers={"Content-Type": "application/json"}
    )
    assert r.status_code in (400, 404), r.text
    assert r.json()["error"]["param"] == param, r.json()


def _keys(typed_dict: Any) -> set[str]:
    return set(typed_dict.__required_keys__ | typed_dict.__optional_keys__)


def test_every_field_of_the_openai_sdk_is_known() -> None:
    """What the official SDK can send is never an unknown field (a newer SDK failing here names its new
    fields: decide for each whether it is a no-op or refused unless neutral, in openai_protocol.py)."""
    assert _keys(completion_create_params.CompletionCreateParamsBase) <= set(CompletionRequest.model_fields)
    assert _keys(chat_create_params.CompletionCreateParamsBase) <= set(ChatCompletionRequest.model_fields)
    assert _keys(chat_completion_stream_options_param.ChatCompletionStreamOptionsParam) <= set(
        StreamOptions.model_fields
    )
    for message in typing.get_args(chat_completion_message_param.ChatCompletionMessageParam):
        assert _keys(message) <= set(ChatMessage.model_fields), message
    parts = [
        *typing.get_args(chat_completion_content_part_param.ChatCompletionContentPartParam),
        chat_completion_content_part_refusal_param.ChatCompletionContentPartRefusalParam,
    ]
    for part in parts:
        assert _keys(part) <= set(ContentPart.model_fields), part


def sdk(engine: Any) -> openai.OpenAI:
    http = TestClient(build_app(engine, api_key=KEY))
    return openai.OpenAI(base_url="http://testserver/v1", api_key=KEY, http_client=http, max_retries=0)


def test_the_sdk_with_every_harmless_field(tokenizer: Any) -> None:
    engine = RecordingEngine(tokenizer=tokenizer)
    api = sdk(engine)
    history = [
        {"role": "developer", "content": "be brief", "name": "dev"},
        {"role": "system", "content": [{"type": "text", "text": "sys"}]},
        {"role": "user", "content": [{"type": "text", "text": "weather?"}], "name": "ann"},
        {
            "role": "assistant",
            "content": None,
            "refusal": None,
            "function_call": None,
            "audio": None,
            "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "w", "arguments": '{"city": "X"}'}}
            ],
        },
        {"role": "tool", "content": "sunny", "tool_call_id": "c1"},
        {"role": "assistant", "content": None, "refusal": "I cannot."},
        {"role": "user", "content": "ok"},
    ]
    chat = api.chat.completions.create(
        model="fake-model",
        messages=history,
        max_completion_tokens=2,
        user="u1",
        metadata={"k": "v"},
        store=False,
        service_tier="auto",
        parallel_tool_calls=True,
        modalities=["text"],
        reasoning_effort="low",
        verbosity="low",
        prediction={"type": "content", "content": "sunny"},
        prompt_cache_key="k",
        safety_identifier="s",
        seed=1,
        n=1,
        temperature=0.5,
        top_p=0.9,
        presence_penalty=0.1,
        frequency_penalty=0.1,
        stop=["\n"],
        logprobs=False,
        tool_choice="none",
        response_format={"type": "text"},
        logit_bias={},
        extra_body={"top_k": 5, "min_p": 0.1, "ignore_eos": True, "use_beam_search": False, "priority": 0},
    )
    assert chat.choices[0].message.content == "t0 t1 " and chat.usage.completion_tokens == 2
    prompt = tokenizer.decode(engine.prompts[-1])
    assert "assistant: I cannot." in prompt and "tool: sunny" in prompt  # a refusal is that message's content
    stream = api.chat.completions.create(
        model="fake-model",
        messages=HI,
        max_tokens=2,
        stream=True,
        stream_options={"include_usage": True, "include_obfuscation": False},
    )
    assert [c.usage.total_tokens for c in stream if c.usage] == [4]
    done = api.completions.create(
        model="fake-model",
        prompt="x",
        max_tokens=2,
        best_of=1,
        echo=False,
        suffix=None,
        logprobs=None,
        user="u",
        n=None,
        presence_penalty=None,
        stream=False,
    )
    assert done.choices[0].text == "t0 t1 "


@pytest.mark.parametrize(
    "field, value",
    [
        ("audio", {"voice": "alloy", "format": "wav"}),
        ("modalities", ["text", "audio"]),
        ("functions", [{"name": "f"}]),
        ("function_call", {"name": "f"}),
        ("web_search_options", {}),
        ("tools", [{"type": "custom", "custom": {"name": "f"}}]),  # only function tools
        ("tool_choice", "required"),  # without tools
        ("chat_template", "{{ messages }}"),
        ("echo", True),
        ("continue_final_message", True),  # and add_generation_prompt (true by default)
        ("chat_template_kwargs", {"tokenize": True}),  # apply_chat_template's own arguments are off limits
    ],
)
def test_unsupported_chat_fields_are_refused_unless_neutral(tokenizer: Any, field: str, value: Any) -> None:
    err = error(
        client(FakeEngine(tokenizer=tokenizer)).post(
            "/v1/chat/completions", json={"messages": HI, field: value}
        )
    )
    assert err["param"] == field, err


def test_unsupported_message_parts_are_refused(tokenizer: Any) -> None:
    c = client(FakeEngine(tokenizer=tokenizer))
    image = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}]
    assert error(c.post("/v1/chat/completions", json={"messages": image}))["param"] == "messages"
    audio = [{"role": "assistant", "content": "x", "audio": {"id": "a1"}}]
    err = error(c.post("/v1/chat/completions", json={"messages": audio}))
    assert err["param"] == "messages" and "audio is not supported" in err["message"]


def test_template_variables(tokenizer: Any) -> None:
    """chat_template_kwargs and reasoning_effort reach the template; continue_final_message leaves the
    last message open; add_special_tokens reaches the encoding of the rendered text."""
    tok = transformers.AutoTokenizer.from_pretrained(tokenizer.name_or_path)
    tok.chat_template = (
        "{{ reasoning_effort }}|{{ enable_thinking }}|{% for m in messages %}{{ m['role'] }}: "
        "{{ m['content'] }}\n{% endfor %}{% if add_generation_prompt %}assistant: {% endif %}"
    )
    encoded: list[dict[str, Any]] = []
    encode = tok.encode
    tok.encode = lambda text, **kwargs: encoded.append(kwargs) or encode(text, **kwargs)
    engine = RecordingEngine(tokenizer=tok)
    c = client(engine)
    body = {
        "messages": HI,
        "max_tokens": 1,
        "reasoning_effort": "high",
        "chat_template_kwargs": {"enable_thinking": True},
    }
    assert c.post("/v1/chat/completions", json=body).status_code == 200
    assert tok.decode(engine.prompts[-1]) == "high|True|user: hi\nassistant: "
    body = {
        "messages": [*HI, {"role": "assistant", "content": "Once upon"}],
        "max_tokens": 1,
        "continue_final_message": True,
        "add_generation_prompt": False,
        "add_special_tokens": True,
    }
    assert c.post("/v1/chat/completions", json=body).status_code == 200
    assert tok.decode(engine.prompts[-1]) == "||user: hi\nassistant: Once upon"
    assert [e["add_special_tokens"] for e in encoded] == [False, True]


# -- vLLM's small endpoints -------------------------------------------------------------------------
def test_tokenize_and_detokenize(tokenizer: Any) -> None:
    engine = FakeEngine(tokenizer=tokenizer)
    engine.max_prompt_chars = 1000
    c = client(engine)
    r = c.post("/tokenize", json={"prompt": "hello world"}).json()
    assert r == {
        "tokens": tokenizer.encode("hello world"),
        "count": len(r["tokens"]),
        "max_model_len": 128,
        "token_strs": None,
    }
    plain = c.post(
        "/tokenize", json={"prompt": "hello world", "add_special_tokens": False, "return_token_strs": True}
    ).json()
    assert plain["tokens"] == tokenizer.encode("hello world", add_special_tokens=False)
    assert plain["token_strs"] == tokenizer.convert_ids_to_tokens(plain["tokens"])
    chat = c.post("/tokenize", json={"messages": HI}).json()
    text = tokenizer.apply_chat_template(HI, add_generation_prompt=True, tokenize=False)
    assert chat["tokens"] == tokenizer.encode(text, add_special_tokens=False) and chat["count"] == len(
        chat["tokens"]
    )
    assert c.post("/detokenize", json={"tokens": plain["tokens"]}).json() == {"prompt": "hello world"}
    # refused: a prompt past the engine's character bound, ids outside the vocabulary, too many ids,
    # unknown fields, no API key
    assert error(c.post("/tokenize", json={"prompt": "x" * 1001}))["param"] == "prompt"
    assert (
        error(c.post("/tokenize", json={"messages": [{"role": "user", "content": "x" * 1001}]}))["param"]
        == "messages"
    )
    assert error(c.post("/detokenize", json={"tokens": [1, len(tokenizer)]}))["param"] == "tokens"
    assert error(c.post("/detokenize", json={"tokens": [-1]}))["param"] == "tokens"
    assert error(c.post("/detokenize", json={"tokens": [1] * 129}))["param"] == "tokens"
    assert (
        error(c.post("/tokenize", json={"prompt": "x", "add_generation_prompt": True}))["param"]
        == "add_generation_prompt"
    )
    assert error(c.post("/tokenize", json={"prompt": "x"}, headers={"Authorization": ""}), 401)
    assert error(c.post("/detokenize", json={"tokens": [1]}, headers={"Authorization": "Bearer no"}), 401)
    assert "no tokenizer" in error(client(FakeEngine()).post("/tokenize", json={"prompt": "x"}))["message"]


def test_version_ping_and_model_card() -> None:
    c = client()
    assert c.get("/ping").status_code == 503 and c.get("/ping").json() == {"status": "loading"}
    c.app.state.server.attach(FakeEngine())
    assert (
        c.get("/version").json()["version"]
        and c.get("/version", headers={"Authorization": ""}).status_code == 200
    )
    assert c.get("/ping").json() == {"status": "ok"}
    assert c.post("/ping", json={}).status_code == 200
    card = c.get("/v1/models/fake-model").json()
    assert card == c.get("/v1/models").json()["data"][0] and card["id"] == "fake-model"
    assert error(c.get("/v1/models/other"), 404)["param"] == "model"
    assert error(c.get("/v1/models/fake-model", headers={"Authorization": ""}), 401)


def test_the_model_card_shows_dtype_and_parallel_layout() -> None:
    # past OpenAI's fields (kept as they are): max_model_len, the weights' dtype, the parallel layout
    card = client(FakeEngine()).get("/v1/models").json()["data"][0]
    assert card == {
        "id": "fake-model",
        "object": "model",
        "created": card["created"],
        "owned_by": "asyncengine",
        "root": "fake-model",
        "max_model_len": 128,
        "dtype": "bfloat16",  # a float16 checkpoint runs as bfloat16 on a CPU
        "parallel": {
            "tensor_parallel_size": 1,
            "pipeline_parallel_size": 1,
            "data_parallel_size": 1,
            "distributed_executor_backend": "mp",
        },
    }
    engine = FakeEngine()
    engine.config.__dict__.update(
        device="cuda",
        tensor_parallel_size=2,
        pipeline_parallel_size=3,
        data_parallel_size=4,
        distributed_executor_backend="ray",
    )
    card = client(engine).get("/v1/models/fake-model").json()
    assert card["dtype"] == "float16"  # on a GPU, the checkpoint's
    assert card["parallel"] == {
        "tensor_parallel_size": 2,
        "pipeline_parallel_size": 3,
        "data_parallel_size": 4,
        "distributed_executor_backend": "ray",
    }
    engine.config.dtype = "float32"  # --dtype wins
    assert client(engine).get("/v1/models").json()["data"][0]["dtype"] == "float32"


# -- docs and schema ----------------------------------------------------------------------------------
def test_docs_and_openapi_are_open_and_offline() -> None:
    c = TestClient(build_app(FakeEngine(), api_key=KEY))  # no API key sent
    page = c.get("/docs")
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    assert "<script" not in page.text and "http" not in page.text.replace("/openapi.json", "")  # no CDN
    assert "/v1/chat/completions" in page.text and "/tokenize" in page.text
    schema = c.get("/openapi.json").json()
    body = schema["paths"]["/v1/completions"]["post"]["requestBody"]["content"]["application/json"]["schema"]
    assert body == {"$ref": "#/components/schemas/CompletionRequest"}
    request = schema["components"]["schemas"]["CompletionRequest"]
    assert request["additionalProperties"] is False and "prompt" in request["required"]
    assert "ChatMessage" in schema["components"]["schemas"]
    responses = schema["paths"]["/v1/chat/completions"]["post"]["responses"]
    assert {"200", "400", "401", "429", "503"} <= set(responses) and "422" not in responses
    # the guard's Host check still applies to them
    guarded = TestClient(
        build_app(FakeEngine(), policy=OriginPolicy.for_bind("127.0.0.1")), base_url="http://evil.example"
    )
    assert guarded.get("/docs").status_code == 421 and guarded.get("/openapi.json").status_code == 421


# -- metrics ----------------------------------------------------------------------------------------
def test_metrics_carry_the_model_name() -> None:
    engine = FakeEngine()
    engine.stats = EngineStats()
    engine.stats.request_success.labels(finished_reason="stop").inc()
    c = TestClient(build_app(engine, model_name="served", limits=ServerLimits()))
    samples = [line for line in c.get("/metrics").text.splitlines() if line and not line.startswith("#")]
    assert samples and all('model_name="served"' in line for line in samples)
    assert 'asyncengine:request_success_total{finished_reason="stop",model_name="served"} 1.0' in samples
    assert 'asyncengine:kv_cache_free_blocks{model_name="served"} 0.0' in samples
    # in-process readers still ask the registry by name alone
    assert (
        engine.stats.registry.get_sample_value(
            "asyncengine:request_success_total", {"finished_reason": "stop"}
        )
        == 1.0
    )
