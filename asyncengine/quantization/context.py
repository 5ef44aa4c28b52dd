"""The quantized linear method that layers built inside `building_with` take their weights from.

A context, not a constructor argument: the model code builds its linear layers without knowing about
quantization (layers/linear.py asks `current_method()`), so no model file changes per format.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from asyncengine.quantization.method import QuantLinearMethod

_stack: list[QuantLinearMethod | None] = [None]


@contextmanager
def building_with(method: QuantLinearMethod | None) -> Iterator[None]:
    """Linear layers created inside the block are quantized with `method` (None: plain weights)."""
    _stack.append(method)
    try:
        yield
    finally:
        _stack.pop()


def current_method() -> QuantLinearMethod | None:
    return _stack[-1]
