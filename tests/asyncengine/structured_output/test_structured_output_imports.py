"""The engine-side structured output (compiling, matching, filling masks) imports neither torch nor
transformers, so the engine process can own it (test_import_layering's rule); the tool parsers too."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

from asyncengine.config import default_model_path

pytestmark = pytest.mark.timeout(120)


def modules_after(code: str) -> list[str]:
    script = textwrap.dedent(code) + "\nimport json, sys\nprint(json.dumps(sorted(sys.modules)))\n"
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=90)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


def heavy(modules: list[str]) -> list[str]:
    return sorted(m for m in modules if m.split(".")[0] in ("torch", "transformers", "xgrammar"))


def test_engine_side_runs_without_torch() -> None:
    modules = modules_after(f"""
        from asyncengine.structured_output import GrammarCompiler, StructuredOutputsParams, allocate_bitmask
        from asyncengine.tokenizer import load_tokenizer, eos_token_ids
        tokenizer = load_tokenizer({default_model_path()!r})
        compiler = GrammarCompiler(tokenizer, 4096, eos_token_ids({default_model_path()!r}, tokenizer))
        matcher = compiler.matcher(StructuredOutputsParams(json={{"type": "object"}}))
        bitmask = allocate_bitmask(1, compiler.vocab_size)
        matcher.fill_bitmask(bitmask)
        assert matcher.accept_tokens(tokenizer.encode("{{}}")) == len(tokenizer.encode("{{}}"))
        assert matcher.is_accepting()
    """)
    assert "llguidance" in modules  # the check ran
    assert heavy(modules) == []


def test_tool_parsers_import_without_torch() -> None:
    modules = modules_after("""
        from asyncengine.entrypoints.tool_parsers import pick_parser, tool_choice_structured_outputs
        tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
        assert tool_choice_structured_outputs(tools, "required") is not None
        assert pick_parser("<tool_call>").extract('<tool_call>{"name": "f"}</tool_call>').tool_calls
    """)
    assert heavy(modules) == []
