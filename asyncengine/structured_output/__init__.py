"""Structured output (issue 22): constraints, their grammars, and the per-request token masks.

Built on llguidance (bench/grammar_backends.py and bench/RESULTS.md say why): torch-free and
transformers-free, so all of it runs in the engine process, which fills each constrained request's
bitmask row before a step and advances its matcher with every accepted token. Applying the masks to
the logits is the worker's: asyncengine.layers.grammar_mask (torch).
"""

from asyncengine.structured_output.bitmask import (
    allocate_bitmask,
    allowed_token_ids,
    bitmask_words,
    is_allowed,
)
from asyncengine.structured_output.compiler import CacheInfo, CompiledGrammar, GrammarCompiler
from asyncengine.structured_output.errors import StructuredOutputError
from asyncengine.structured_output.from_request import structured_outputs_from_request
from asyncengine.structured_output.matcher import GrammarMatcher, fill_bitmasks
from asyncengine.structured_output.spec import StructuredOutputsParams

__all__ = [
    "CacheInfo",
    "CompiledGrammar",
    "GrammarCompiler",
    "GrammarMatcher",
    "StructuredOutputError",
    "StructuredOutputsParams",
    "allocate_bitmask",
    "allowed_token_ids",
    "bitmask_words",
    "fill_bitmasks",
    "is_allowed",
    "structured_outputs_from_request",
]
