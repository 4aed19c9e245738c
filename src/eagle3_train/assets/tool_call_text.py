"""Tool calls written as text, Hermes style: `<tool_call>{"name": ..., "arguments": ...}</tool_call>` in an assistant
turn, its result as a `tool` turn wrapped in `<tool_response>...</tool_response>` (NousResearch's
hermes-function-calling-v1 and the sets built like it).

Read as structured calls, the verifier's chat template renders them its own way (and a tool result after a turn
without calls would end the conversation as broken). The payload is JSON or, as that set writes it, a Python dict
literal; a block that is neither leaves the turn as text.

Python API: `split_text_calls(text) -> (text_without_calls, calls) | None`, `unwrap_tool_response(text) -> str`.
"""

from __future__ import annotations

import ast
import json
import re
from typing import Any

_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.S)
_RESPONSE = re.compile(r"\s*<tool_response>\s*(.*?)\s*</tool_response>\s*", re.S)


def _payload(text: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        pass
    try:
        return ast.literal_eval(text)  # literals only: no code runs
    except (ValueError, SyntaxError, MemoryError, RecursionError):
        return None


def split_text_calls(text: str) -> tuple[str, list[dict[str, Any]]] | None:
    """The text outside the `<tool_call>` blocks and the calls as OpenAI `tool_calls` (no ids); None when `text` has
    no block, or one that is not {"name", "arguments"}."""
    payloads = _CALL.findall(text)
    if not payloads:
        return None
    calls = []
    for p in payloads:
        call = _payload(p)
        if not isinstance(call, dict) or not isinstance(call.get("name"), str):
            return None
        arguments = call.get("arguments", {})
        if not isinstance(arguments, dict | str):
            return None
        calls.append({"type": "function", "function": {"name": call["name"], "arguments": arguments}})
    return _CALL.sub("", text).strip(), calls


def unwrap_tool_response(text: str) -> str:
    """A tool result without its `<tool_response>` wrapper (the template adds its own)."""
    m = _RESPONSE.fullmatch(text)
    return m.group(1) if m else text
