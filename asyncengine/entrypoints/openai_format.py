"""How the completions and chat completions routes spell their answers: whole responses, streamed chunks
and the usage chunk, with OpenAI's two logprobs formats, and chat's tool calls (chat_tools.py)."""

from __future__ import annotations

from typing import Any

from asyncengine.engine import AsyncEngine
from asyncengine.entrypoints.chat_tools import ToolCalling, delta_dicts, finish_reason
from asyncengine.entrypoints.openai_responses import (
    ChatChoice,
    ChatCompletionChunk,
    ChatCompletionResponse,
    ChatLogprobs,
    ChatResponseMessage,
    ChatStreamChoice,
    CompletionChoice,
    CompletionLogprobs,
    CompletionResponse,
    TokenLogprob,
    TopLogprob,
    usage,
)
from asyncengine.entrypoints.streams import MIN_LOGPROB, clamp
from asyncengine.entrypoints.tool_parsers import ToolCallStream
from asyncengine.outputs import CompletionOutput, Logprob


def _token_text(token_id: int, lp: Logprob | None, engine: AsyncEngine) -> str:
    if lp is not None and lp.decoded_token is not None:
        return lp.decoded_token
    return engine.tokenizer.decode([token_id]) if engine.tokenizer is not None else f"token_id:{token_id}"


def completion_logprobs(c: CompletionOutput, engine: AsyncEngine, offset: int) -> CompletionLogprobs:
    """OpenAI's legacy logprobs object; text_offset counts from `offset` (characters streamed so far)."""
    out = CompletionLogprobs()
    for token_id, table in zip(c.token_ids, c.logprobs or []):
        sampled = table.get(token_id)
        text = _token_text(token_id, sampled, engine)
        out.tokens.append(text)
        out.token_logprobs.append(clamp(sampled.logprob) if sampled else None)
        out.top_logprobs.append({_token_text(t, lp, engine): clamp(lp.logprob) for t, lp in table.items()})
        out.text_offset.append(offset)
        offset += len(text)
    return out


def chat_logprobs(c: CompletionOutput, engine: AsyncEngine, top_n: int) -> ChatLogprobs:
    content = []
    for token_id, table in zip(c.token_ids, c.logprobs or []):
        sampled = table.get(token_id)
        text = _token_text(token_id, sampled, engine)
        top = sorted(table.items(), key=lambda kv: kv[1].rank)[:top_n]
        content.append(
            TokenLogprob(
                token=text,
                logprob=clamp(sampled.logprob) if sampled else MIN_LOGPROB,
                bytes=list(text.encode()),
                top_logprobs=[
                    TopLogprob(
                        token=(s := _token_text(t, lp, engine)),
                        logprob=clamp(lp.logprob),
                        bytes=list(s.encode()),
                    )
                    for t, lp in top
                ],
            )
        )
    return ChatLogprobs(content=content)


class Format:
    """How one endpoint spells its responses; streaming when params ask for deltas."""

    has_logprobs = False
    token_ids = False  # chunks carry token ids (so a chunk with ids and no text yet is still sent)

    def __init__(self, engine: AsyncEngine) -> None:
        self.engine = engine
        self.offsets: dict[int, int] = {}

    def full(self, request_id: str, created: int, model: str, finals: list, n: int) -> Any:
        raise NotImplementedError

    def chunks(self, request_id: str, created: int, model: str, index: int, c: CompletionOutput) -> list[str]:
        """The JSON chunks (maybe none) that one output of choice `index` streams."""
        raise NotImplementedError

    def usage_chunk(self, request_id: str, created: int, model: str, total: Any) -> str:
        raise NotImplementedError


class CompletionFormat(Format):
    def __init__(self, engine: AsyncEngine, logprobs: bool, token_ids: bool = False) -> None:
        super().__init__(engine)
        self.has_logprobs = logprobs
        self.token_ids = token_ids

    def _lp(self, index: int, c: CompletionOutput) -> CompletionLogprobs | None:
        if not self.has_logprobs:
            return None
        lp = completion_logprobs(c, self.engine, self.offsets.get(index, 0))
        self.offsets[index] = self.offsets.get(index, 0) + len(c.text)
        return lp

    def full(self, request_id: str, created: int, model: str, finals: list, n: int) -> CompletionResponse:
        ids = self.token_ids
        choices = [
            CompletionChoice(
                index=i * n + c.index,
                text=c.text,
                logprobs=self._lp(i * n + c.index, c),
                finish_reason=c.finish_reason,
                token_ids=list(c.token_ids) if ids else None,
                prompt_token_ids=list(out.prompt_token_ids) if ids else None,
            )
            for i, out in enumerate(finals)
            for c in out.outputs
        ]
        prompt_tokens = sum(len(out.prompt_token_ids) for out in finals)
        completion_tokens = sum(len(c.token_ids) for out in finals for c in out.outputs)
        choices.sort(key=lambda ch: ch.index)
        return CompletionResponse(
            id=request_id,
            created=created,
            model=model,
            choices=choices,
            usage=usage(prompt_tokens, completion_tokens),
        )

    def chunks(self, request_id: str, created: int, model: str, index: int, c: CompletionOutput) -> list[str]:
        shows_ids = c.token_ids and (self.has_logprobs or self.token_ids)
        if c.finish_reason is None and not c.text and not shows_ids:
            return []  # nothing to show yet (e.g. half a UTF-8 character is held back)
        choice = CompletionChoice(
            index=index,
            text=c.text,
            logprobs=self._lp(index, c),
            finish_reason=c.finish_reason,
            token_ids=list(c.token_ids) if self.token_ids else None,
        )
        chunk = CompletionResponse(id=request_id, created=created, model=model, choices=[choice])
        return [chunk.model_dump_json()]

    def usage_chunk(self, request_id: str, created: int, model: str, total: Any) -> str:
        return CompletionResponse(
            id=request_id, created=created, model=model, choices=[], usage=total
        ).model_dump_json()


class ChatFormat(Format):
    def __init__(
        self, engine: AsyncEngine, top_logprobs: int | None, tools: ToolCalling | None = None
    ) -> None:
        super().__init__(engine)
        self.top_logprobs = top_logprobs
        self.has_logprobs = top_logprobs is not None
        self.tools = tools
        self.started: set[int] = set()
        self.streams: dict[int, ToolCallStream] = {}  # per choice, with tools

    def _lp(self, c: CompletionOutput) -> ChatLogprobs | None:
        return None if self.top_logprobs is None else chat_logprobs(c, self.engine, self.top_logprobs)

    def _choice(self, c: CompletionOutput) -> ChatChoice:
        message, has_calls = (
            (ChatResponseMessage(content=c.text), False) if self.tools is None else self.tools.message(c.text)
        )
        return ChatChoice(
            index=c.index,
            message=message,
            logprobs=self._lp(c),
            finish_reason=finish_reason(c.finish_reason, has_calls),
        )

    def full(self, request_id: str, created: int, model: str, finals: list, n: int) -> ChatCompletionResponse:
        out = finals[0]
        return ChatCompletionResponse(
            id=request_id,
            created=created,
            model=model,
            choices=[self._choice(c) for c in out.outputs],
            usage=usage(len(out.prompt_token_ids), sum(len(c.token_ids) for c in out.outputs)),
        )

    def chunks(self, request_id: str, created: int, model: str, index: int, c: CompletionOutput) -> list[str]:
        deltas, reason = self._deltas(index, c)
        logprobs = self._lp(c)
        if not deltas and reason is None and not (c.token_ids and logprobs is not None):
            return []  # nothing to show yet (half a UTF-8 character, text a tool parser holds back)
        empty: dict[str, Any] = {"content": ""} if self.tools is None else {}
        if not deltas:  # the end, or logprobs of tokens whose text is held back
            deltas = [dict(empty)]
        choices = []
        if index not in self.started:  # the first chunk of a choice names the role
            # NOTE: choices below this one that have not started (their text held back) name theirs first:
            # the openai SDK's stream accumulator takes a choice's first chunk as its list position
            for earlier in range(index):
                if earlier not in self.started:
                    self.started.add(earlier)
                    choices.append(ChatStreamChoice(index=earlier, delta={"role": "assistant", **empty}))
            self.started.add(index)
            deltas[0] = {"role": "assistant", **deltas[0]}
        for i, delta in enumerate(deltas):
            choices.append(
                ChatStreamChoice(
                    index=index,
                    delta=delta,
                    logprobs=logprobs if i == 0 else None,
                    finish_reason=reason if i == len(deltas) - 1 else None,
                )
            )
        return [
            ChatCompletionChunk(id=request_id, created=created, model=model, choices=[ch]).model_dump_json()
            for ch in choices
        ]

    def _deltas(self, index: int, c: CompletionOutput) -> tuple[list[dict[str, Any]], str | None]:
        """Choice `index`'s deltas for output `c`, and its finish reason (None until it finishes)."""
        if self.tools is None:
            return ([{"content": c.text}] if c.text else []), c.finish_reason
        stream = self.streams.get(index)
        if stream is None:
            stream = self.streams[index] = self.tools.stream()
        deltas = stream.feed(c.text) if c.text else []
        if c.finish_reason is not None:
            deltas += stream.finish()
        return delta_dicts(deltas), finish_reason(c.finish_reason, stream.num_calls > 0)

    def usage_chunk(self, request_id: str, created: int, model: str, total: Any) -> str:
        return ChatCompletionChunk(
            id=request_id, created=created, model=model, choices=[], usage=total
        ).model_dump_json()
