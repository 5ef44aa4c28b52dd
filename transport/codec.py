"""Typed msgpack codecs bound to one message union each; decoding only ever yields those types."""

from __future__ import annotations

from typing import Any, Generic, TypeVar

import msgspec

from asyncengine.transport.wire import EngineMessage, WorkerMessage

T = TypeVar("T")


class Codec(Generic[T]):
    def __init__(self, message_type: Any) -> None:
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder = msgspec.msgpack.Decoder(message_type)

    def encode(self, message: T) -> bytes:
        return self._encoder.encode(message)

    def decode(self, data: bytes | memoryview) -> T:
        """Raises msgspec.DecodeError / ValidationError (subclasses of msgspec.MsgspecError) on bad bytes."""
        return self._decoder.decode(data)


def engine_codec() -> Codec[EngineMessage]:
    return Codec(EngineMessage)


def worker_codec() -> Codec[WorkerMessage]:
    return Codec(WorkerMessage)
