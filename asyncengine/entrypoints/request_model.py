"""RequestModel: a strict request body, whose every problem is a 400 naming the field.

Unknown fields are refused, with the closest known name where one is near (a typo is not a request for the
default); types are strict (`"4"`, `true` and `2.0` are no integers); NEUTRAL lists known fields a server
does not implement, accepted only at the values that ask for nothing.
"""

from __future__ import annotations

import difflib
import json
from typing import Any, ClassVar, TypeVar

import pydantic
from pydantic import BaseModel, ConfigDict

from asyncengine.entrypoints.api_errors import ApiError

STRICT = ConfigDict(extra="forbid", strict=True)


class RequestModel(BaseModel):
    """A request object: unknown fields are a 400; NEUTRAL lists the known fields this server does not
    implement and the values at which they ask for nothing (any other value is a 400 naming the field)."""

    model_config = STRICT
    NEUTRAL: ClassVar[dict[str, tuple[Any, ...]]] = {}

    def check_neutral(self) -> None:
        for name, neutral in self.NEUTRAL.items():
            if getattr(self, name) not in neutral:
                allowed = " or ".join(json.dumps(v) for v in neutral)
                raise ApiError(f"{name} is not supported (only {allowed})", param=name)


RequestModelT = TypeVar("RequestModelT", bound=RequestModel)


def _suggestion(name: str, model: type[BaseModel] | None) -> str:
    if model is None:
        return ""
    close = difflib.get_close_matches(name, list(model.model_fields), n=1, cutoff=0.75)
    return f" (did you mean {close[0]}?)" if close else ""


def validation_error(exc: pydantic.ValidationError | Any, model: type[BaseModel] | None = None) -> ApiError:
    """A 400 for pydantic's (or FastAPI's) validation error: the first few problems by path, `param` the
    first one's top-level field; an unknown field is called so, with the closest known name of `model`."""
    parts = []
    params = []
    for err in exc.errors()[:5]:
        loc = [x for x in err.get("loc", ()) if x != "body"]
        where = ".".join(str(x) for x in loc)
        if loc and isinstance(loc[0], str):
            params.append(loc[0])
        if err.get("type") == "extra_forbidden":
            hint = _suggestion(str(loc[-1]), model) if len(loc) == 1 else ""
            parts.append(f"{where}: unrecognized request argument{hint}")
        else:
            parts.append(f"{where}: {err.get('msg')}" if where else str(err.get("msg")))
    return ApiError("invalid request: " + "; ".join(parts), param=params[0] if params else None)


def parse_request(model: type[RequestModelT], body: bytes) -> RequestModelT:
    """The request `body` (JSON) as `model`, or an ApiError (400) naming the problem and its field."""
    try:
        return model.model_validate_json(body)
    except pydantic.ValidationError as e:
        raise validation_error(e, model) from None
