"""The error a request gets for a structured-output constraint that can never be served."""

from __future__ import annotations

from asyncengine.errors import InvalidRequestError


class StructuredOutputError(InvalidRequestError):
    """A schema, regex, choice list or grammar that is malformed, or not exactly one of them; HTTP 400.

    `param` names the request field to blame (e.g. "structured_outputs.regex", "guided_json",
    "response_format.json_schema.schema"), as SamplingParamsError does, so the API answers OpenAI's
    error body with it."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(f"{param}: {message}" if param else message)
        self.param = param
