"""How the completions and chat completions routes spell their answers: whole responses, streamed chunks
and the usage chunk, with OpenAI's two logprobs formats."""

from __future__ import annotations

from typing import Any

from asyncengine.engine import AsyncEngine
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

    def chunk(self, request_id: str, created: int, model: str, index: int, c: CompletionOutput) -> str:
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

    def chunk(self, request_id: str, created: int, model: str, index: int, c: CompletionOutput) -> str:
        choice = CompletionChoice(
            index=index,
            text=c.text,
            logprobs=self._lp(index, c),
            finish_reason=c.finish_reason,
            token_ids=list(c.token_ids) if self.token_ids else None,
        )
        return CompletionResponse(
            id=request_id, created=created, model=model, choices=[choice]
        ).model_dump_json()

    def usage_chunk(self, request_id: str, created: int, model: str, total: Any) -> str:
        return CompletionResponse(
            id=request_id, created=created, model=model, choices=[], usage=total
        ).model_dump_json()


class ChatFormat(Format):
    def __init__(self, engine: AsyncEngine, top_logprobs: int | None) -> None:
        super().__init__(engine)
        self.top_logprobs = top_logprobs
        self.has_logprobs = top_logprobs is not None
        self.started: set[int] = set()

    def _lp(self, c: CompletionOutput) -> ChatLogprobs | None:
        return None if self.top_logprobs is None else chat_logprobs(c, self.engine, self.top_logprobs)

    def full(self, request_id: str, created: int, model: str, finals: list, n: int) -> ChatCompletionResponse:
        out = finals[0]
        choices = [
            ChatChoice(
                index=c.index,
                message=ChatResponseMessage(content=c.text),
                logprobs=self._lp(c),
                finish_reason=c.finish_reason,
            )
            for c in out.outputs
        ]
        return ChatCompletionResponse(
            id=request_id,
            created=created,
            model=model,
            choices=choices,
            usage=usage(len(out.prompt_token_ids), sum(len(c.token_ids) for c in out.outputs)),
        )

    def chunk(self, request_id: str, created: int, model: str, index: int, c: CompletionOutput) -> str:
        delta = {"content": c.text}
        if index not in self.started:  # the first chunk of a choice names the role
            self.started.add(index)
            delta = {"role": "assistant", "content": c.text}
        choice = ChatStreamChoice(
            index=index, delta=delta, logprobs=self._lp(c), finish_reason=c.finish_reason
        )
        return ChatCompletionChunk(
            id=request_id, created=created, model=model, choices=[choice]
        ).model_dump_json()

    def usage_chunk(self, request_id: str, created: int, model: str, total: Any) -> str:
        return ChatCompletionChunk(
            id=request_id, created=created, model=model, choices=[], usage=total
        ).model_dump_json()
