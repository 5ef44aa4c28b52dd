"""SamplingParams: a msgspec Struct validated on construction, sent once per request to the workers."""

from __future__ import annotations

import enum
import math

import msgspec

from asyncengine.errors import InvalidRequestError
from asyncengine.structured_output.spec import StructuredOutputsParams

MAX_STOP_STRINGS = 64
MAX_STOP_STRING_LEN = 256
MAX_LOGPROBS = 20
MAX_STOP_TOKEN_IDS = 256
# NOTE: every integer crosses to the workers as msgpack (ints beyond 64 bits cannot be encoded) and into
# int32 tensors there, so counts and token ids are bounded to int32 at the boundary
MAX_INT32 = 2**31 - 1


class OutputKind(enum.IntEnum):
    CUMULATIVE = 0  # every RequestOutput holds all text and tokens so far
    DELTA = 1  # every RequestOutput holds only what is new since the last one
    FINAL_ONLY = 2  # one RequestOutput, when the request finishes


class SamplingParamsError(InvalidRequestError):
    """A SamplingParams field is out of range; `param` names it (None where no one field is to blame)."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class SamplingParams(msgspec.Struct, omit_defaults=True, kw_only=True, forbid_unknown_fields=True):
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1 = off
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16  # None = up to the context length
    min_tokens: int = 0
    stop: list[str] = msgspec.field(default_factory=list)
    stop_token_ids: list[int] = msgspec.field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None  # top-k logprobs per sampled token (the sampled one is always included)
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    output_kind: OutputKind = OutputKind.CUMULATIVE
    # constrain the output to a JSON schema, regex, choice or grammar (vLLM's structured_outputs)
    structured_outputs: StructuredOutputsParams | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):  # OpenAI lets `stop` be one string
            self.stop = [self.stop]
        if self.top_k == -1:
            self.top_k = 0
        self.validate()

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def has_penalties(self) -> bool:
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0

    def validate(self) -> None:
        """Raises SamplingParamsError naming the first field of the wrong type or out of range."""

        def check(ok: bool, message: str, param: str) -> None:
            if not ok:
                raise SamplingParamsError(message, param)

        def integer(name: str, value: object, lo: int, hi: int) -> None:
            param = name.removesuffix("[]")
            check(isinstance(value, int) and not isinstance(value, bool), f"{name} must be an integer", param)
            check(
                lo <= value <= hi,  # type: ignore[operator]
                f"{name} must be in [{lo}, {hi}], got {value}",
                param,
            )

        def finite(name: str) -> float:
            value = getattr(self, name)
            check(
                isinstance(value, (int, float)) and not isinstance(value, bool),
                f"{name} must be a number",
                name,
            )
            check(math.isfinite(value), f"{name} must be finite, got {value}", name)
            return float(value)

        integer("n", self.n, 1, 64)
        check(
            finite("temperature") >= 0.0, f"temperature must be >= 0, got {self.temperature}", "temperature"
        )
        check(0.0 < finite("top_p") <= 1.0, f"top_p must be in (0, 1], got {self.top_p}", "top_p")
        integer("top_k", self.top_k, 0, MAX_INT32)  # -1 (off) became 0 in __post_init__
        check(0.0 <= finite("min_p") <= 1.0, f"min_p must be in [0, 1], got {self.min_p}", "min_p")
        if self.seed is not None:
            integer("seed", self.seed, 0, 2**63 - 1)
        if self.max_tokens is not None:
            integer("max_tokens", self.max_tokens, 1, MAX_INT32)
        integer("min_tokens", self.min_tokens, 0, MAX_INT32)
        check(
            self.max_tokens is None or self.min_tokens <= self.max_tokens,
            f"min_tokens ({self.min_tokens}) must be <= max_tokens ({self.max_tokens})",
            "min_tokens",
        )
        check(isinstance(self.stop, list), "stop must be a string or a list of strings", "stop")
        check(len(self.stop) <= MAX_STOP_STRINGS, f"at most {MAX_STOP_STRINGS} stop strings", "stop")
        for s in self.stop:
            check(
                isinstance(s, str) and 0 < len(s) <= MAX_STOP_STRING_LEN,
                f"stop strings must be 1..{MAX_STOP_STRING_LEN} characters",
                "stop",
            )
        check(
            isinstance(self.stop_token_ids, list),
            "stop_token_ids must be a list of integers",
            "stop_token_ids",
        )
        check(
            len(self.stop_token_ids) <= MAX_STOP_TOKEN_IDS,
            f"at most {MAX_STOP_TOKEN_IDS} stop_token_ids",
            "stop_token_ids",
        )
        for t in self.stop_token_ids:
            integer("stop_token_ids[]", t, 0, MAX_INT32)
        if self.logprobs is not None:
            integer("logprobs", self.logprobs, 0, MAX_LOGPROBS)
        check(
            -2.0 <= finite("presence_penalty") <= 2.0,
            "presence_penalty must be in [-2, 2]",
            "presence_penalty",
        )
        check(
            -2.0 <= finite("frequency_penalty") <= 2.0,
            "frequency_penalty must be in [-2, 2]",
            "frequency_penalty",
        )
        check(
            0.0 < finite("repetition_penalty") <= 10.0,
            "repetition_penalty must be in (0, 10]",
            "repetition_penalty",
        )
        for name in ("ignore_eos", "skip_special_tokens", "include_stop_str_in_output"):
            check(isinstance(getattr(self, name), bool), f"{name} must be true or false", name)
        check(isinstance(self.output_kind, OutputKind), "output_kind must be an OutputKind", "output_kind")
        if self.structured_outputs is not None:
            check(
                isinstance(self.structured_outputs, StructuredOutputsParams),
                "structured_outputs must be a StructuredOutputsParams",
                "structured_outputs",
            )
            self.structured_outputs.validate()  # StructuredOutputError (a 400) naming the field

    @classmethod
    def from_dict(cls, fields: dict) -> SamplingParams:
        """Builds params from untrusted JSON-like data: wrong types and unknown fields are typed errors.

        Strict, as OpenAI is: "4" is no integer, 2.0 no count and true no number (ints pass as floats).
        """
        if isinstance(fields.get("stop"), str):  # OpenAI lets `stop` be one string
            fields = {**fields, "stop": [fields["stop"]]}
        try:
            return msgspec.convert(fields, cls, strict=True)
        except msgspec.ValidationError as e:
            raise SamplingParamsError(f"invalid sampling params: {e}") from None
