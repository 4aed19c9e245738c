"""One record, one conversation: a record of any shape `record_shapes.py` knows (ShareGPT `conversations`,
OpenAI-style `messages`, either list with from/value or role/content turns, or a column pair such as
question/answer) turned into the chat-template messages every stage works on, and the turn structure training accepts.

Role names are mapped through `ROLE_ALIASES`; tool calls (OpenAI `tool_calls`, ShareGPT `function_call` turns, Hermes
`<tool_call>` text answered by tool turns: `tool_call_text.py`), tool results, reasoning text and `generate`'s own
fields (`regenerated`, `completion_token_ids`) are kept and checked here, so a malformed record fails with the file,
record and field named. A record without an id gets its content hash, which also finds records that repeat another
word for word.

Python API: `parse_record(record, path, n, line) -> (format, Conversation)`, `messages_record(conversation) -> dict`
(a conversation written back as a `messages` record that reads the same), `messages_digest(messages)`,
`normalize_turns(messages, leading_assistant="trim") -> (messages, reason)`.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from eagle3_train.assets.record_shapes import SHAPES_TEXT, pair_turns, shape_of
from eagle3_train.assets.tool_call_text import split_text_calls, unwrap_tool_response
from eagle3_train.utils.io import Eagle3InputError

# Role names seen in ShareGPT dumps and OpenAI-style files, mapped to the chat-template roles.
ROLE_ALIASES = {
    "system": "system",
    "human": "user", "user": "user",
    "gpt": "assistant", "assistant": "assistant", "chatgpt": "assistant", "bing": "assistant", "bard": "assistant",
    # tool results: OpenAI's `tool` (and legacy `function`), ShareGPT-style `observation`
    "tool": "tool", "function": "tool", "observation": "tool",
    # ShareGPT-style function calls: an assistant turn whose value is {"name", "arguments"} JSON
    "function_call": "assistant",
}
_CALL_ROLES = {"function_call"}

# What `generate` writes on an assistant message beside role and content, kept for `prepare`: whether the verifier
# produced it (`regenerated: false` on a source turn kept as given) and the token ids it generated.
REGENERATED = "regenerated"
TOKEN_IDS = "completion_token_ids"


@dataclass
class Conversation:
    id: str
    messages: list[dict[str, str]]
    tools: list[dict[str, Any]] | None = None  # the functions the conversation offers (OpenAI `tools`)


def messages_record(conv: Conversation) -> dict[str, Any]:
    """`conv` as a `messages` record: `parse_record` reads it back to the same conversation (mixtures, slices)."""
    return {"id": conv.id, "messages": conv.messages, **({"tools": conv.tools} if conv.tools else {})}


def _content(value: Any, where: str, field_name: str) -> str:
    if value is None:
        return ""
    if isinstance(value, str):
        return _text(value, where, field_name)
    if isinstance(value, list):  # OpenAI content parts: keep the text parts
        parts = []
        for part in value:
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise Eagle3InputError(f"{where}: field '{field_name}' holds a non-text content part; expected a "
                                       f"string or a list of {{'type': 'text', 'text': ...}}")
            parts.append(part["text"])
        return _text("".join(parts), where, field_name)
    raise Eagle3InputError(f"{where}: field '{field_name}' must be a string, got {type(value).__name__}")


def _text(value: str, where: str, field_name: str) -> str:
    """`value`, refused when a JSON escape made it hold a lone UTF-16 surrogate ("\\ud800"): not encodable text."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as e:
        raise Eagle3InputError(f"{where}: field '{field_name}' holds an unpaired surrogate escape "
                               f"(\\u{ord(value[e.start]):04x}), which is not text") from None
    return value


def messages_digest(messages: list[dict[str, str]]) -> str:
    """SHA-256 of a conversation's messages: its id when the file gives none, and what makes two records the same."""
    return hashlib.sha256(json.dumps(messages, sort_keys=True).encode()).hexdigest()


def parse_record(record: Any, path: Path, n: int, line: int) -> tuple[str, Conversation]:
    where = f"{path}, record {n} (line {line})"
    if not isinstance(record, dict):
        raise Eagle3InputError(f"{where}: expected a JSON object with 'conversations' (ShareGPT) or 'messages' "
                               f"(OpenAI style), got {type(record).__name__}")
    shape = shape_of(record)
    if shape is None:
        raise Eagle3InputError(f"{where}: missing field {SHAPES_TEXT}; found keys {sorted(record)}")
    fmt, (role_key, content_key) = shape.name, shape.turn_keys
    list_key = shape.list_key or shape.name
    turns = record[list_key] if shape.list_key else pair_turns(record, shape, where)
    if not isinstance(turns, list):
        raise Eagle3InputError(f"{where}: field '{list_key}' must be a list of turns, got {type(turns).__name__}")
    messages = []
    system = record.get("system")  # a top-level system prompt (OpenThoughts and other ShareGPT-style sets)
    if isinstance(system, str) and system.strip() and not any(
            isinstance(t, dict) and str(t.get(role_key, "")).lower() == "system" for t in turns):
        messages.append({"role": "system", "content": _content(system, where, "system")})
    for j, turn in enumerate(turns):
        twhere = f"{where}, {list_key}[{j}]"
        if not isinstance(turn, dict) or role_key not in turn or content_key not in turn:
            raise Eagle3InputError(f"{twhere}: expected an object with fields '{role_key}' and '{content_key}'")
        role = turn[role_key]
        canonical = ROLE_ALIASES.get(role.lower()) if isinstance(role, str) else None
        if canonical is None:
            raise Eagle3InputError(f"{twhere}: unknown role {role!r} in field '{role_key}'; expected one of "
                                   f"{sorted(ROLE_ALIASES)}")
        if role.lower() in _CALL_ROLES:
            message = {"role": "assistant", "content": "",
                       "tool_calls": _tool_calls([_sharegpt_call(turn[content_key], twhere, content_key)], twhere)}
        else:
            message = {"role": canonical, "content": _content(turn[content_key], twhere, content_key)}
        reasoning = turn.get("reasoning_content", turn.get("reasoning"))  # kept by `generate` for thinking models
        if canonical == "assistant" and reasoning:
            message["reasoning_content"] = _content(reasoning, twhere, "reasoning_content")
        if canonical == "assistant" and turn.get("tool_calls"):
            message["tool_calls"] = _tool_calls(turn["tool_calls"], twhere)
        if canonical == "assistant":
            _generated_fields(turn, message, twhere)
        if canonical == "tool":
            for key in ("tool_call_id", "name"):
                if turn.get(key) is not None:
                    message[key] = _text(str(turn[key]), twhere, key)
        if messages and messages[-1]["role"] == "assistant" and message["role"] == "assistant" \
                and "tool_calls" in message and not messages[-1].get("tool_calls") and not message["content"]:
            # ShareGPT-style: the call follows the assistant's text as its own turn; one assistant message holds both
            messages[-1]["tool_calls"] = message["tool_calls"]
            continue
        messages.append(message)
    _structure_text_calls(messages, where)
    cid = record.get("id")
    if cid is None or cid == "":
        # No id in the file: a content hash is stable across runs and limits.
        cid = messages_digest(messages)[:16]
    tools = _tools(record["tools"], where) if record.get("tools") not in (None, "", []) else None
    return fmt, Conversation(id=_text(str(cid), where, "id"), messages=messages, tools=tools)


def _structure_text_calls(messages: list[dict[str, Any]], where: str) -> None:
    """Hermes-style calls written as `<tool_call>` text in an assistant turn that tool turns answer become its
    `tool_calls`, and those results lose their `<tool_response>` wrapper; a generated turn is kept as generated."""
    answered = False
    for i, m in enumerate(messages):
        if m["role"] == "tool":
            if answered:
                m["content"] = unwrap_tool_response(m["content"])
            continue
        answered = False
        following = messages[i + 1]["role"] if i + 1 < len(messages) else None
        if m["role"] != "assistant" or following != "tool" or m.get("tool_calls") or TOKEN_IDS in m \
                or REGENERATED in m:
            continue
        found = split_text_calls(m["content"])
        if found is not None:
            m["content"], calls = found
            m["tool_calls"] = _tool_calls(calls, where)
            answered = True


def _generated_fields(turn: dict[str, Any], message: dict[str, Any], where: str) -> None:
    """`generate`'s own fields of an assistant turn, checked: `regenerated` (a bool) and `completion_token_ids`."""
    if REGENERATED in turn:
        if not isinstance(turn[REGENERATED], bool):
            raise Eagle3InputError(f"{where}: field '{REGENERATED}' must be true or false, got {turn[REGENERATED]!r}")
        message[REGENERATED] = turn[REGENERATED]
    ids = turn.get(TOKEN_IDS)
    if ids is not None:
        if not isinstance(ids, list) or not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0
                                                for i in ids):
            raise Eagle3InputError(f"{where}: field '{TOKEN_IDS}' must be a list of token ids (integers >= 0)")
        message[TOKEN_IDS] = ids


def _tools(value: Any, where: str) -> list[dict[str, Any]]:
    """A record's `tools`: OpenAI's [{"type": "function", "function": {"name", "description"?, "parameters"?}}],
    bare function schemas ({"name", ...}), or either as JSON text (as Glaive/xLAM-style sets store it)."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError:
            raise Eagle3InputError(f"{where}: field 'tools' is text but not JSON: {value[:80]!r}") from None
    if not isinstance(value, list):
        raise Eagle3InputError(f"{where}: field 'tools' must be a list of functions, got {type(value).__name__}")
    tools = []
    for i, tool in enumerate(value):
        fn = tool.get("function", tool) if isinstance(tool, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
            raise Eagle3InputError(f"{where}: tools[{i}] must be {{'type': 'function', 'function': {{'name', "
                                   f"'parameters'}}}} or a function schema with a 'name', got {str(tool)[:80]!r}")
        tools.append({"type": "function", "function": fn})
    return tools


def _sharegpt_call(value: Any, where: str, field_name: str) -> dict[str, Any]:
    """A ShareGPT-style `function_call` turn's value ({"name", "arguments"} as JSON text) as an OpenAI call."""
    try:
        call = json.loads(value) if isinstance(value, str) else value
    except json.JSONDecodeError:
        call = None
    if not isinstance(call, dict) or not isinstance(call.get("name"), str):
        raise Eagle3InputError(f"{where}: field '{field_name}' of a function_call turn must be JSON with 'name' and "
                               f"'arguments', got {str(value)[:80]!r}")
    return {"type": "function", "function": {"name": call["name"], "arguments": call.get("arguments", {})}}


def _tool_calls(value: Any, where: str) -> list[dict[str, Any]]:
    """OpenAI `tool_calls`: [{"id"?, "type": "function", "function": {"name", "arguments" (JSON text or object)}}];
    calls without an id get `call_<i>` (templates print it, tool results refer to it)."""
    if not isinstance(value, list):
        raise Eagle3InputError(f"{where}: field 'tool_calls' must be a list, got {type(value).__name__}")
    calls = []
    for i, call in enumerate(value):
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise Eagle3InputError(f"{where}: tool_calls[{i}] must be {{'type': 'function', 'function': {{'name', "
                                   f"'arguments'}}}}, got {str(call)[:80]!r}")
        arguments = fn.get("arguments", {})
        if not isinstance(arguments, (str, dict)):
            raise Eagle3InputError(f"{where}: tool_calls[{i}].function.arguments must be JSON text or an object")
        calls.append({"id": str(call.get("id") or f"call_{i}"), "type": "function",
                      "function": {"name": _text(fn["name"], where, "tool_calls.function.name"),
                                   "arguments": arguments}})
    return calls


def normalize_turns(messages: list[dict[str, str]], leading_assistant: str = "trim"
                    ) -> tuple[list[dict[str, str]] | None, str | None]:
    """Check a conversation's turn structure; return (messages, None) or (None, skip reason).

    Accepted: an optional system message first, then user/assistant alternating, starting with user, with at least
    one assistant turn and no empty turn; an assistant turn with `tool_calls` (its text may be empty) is followed by
    its tool results (`tool` turns) and then the assistant again. ShareGPT splits long chats into parts whose later
    parts start with the assistant: with `leading_assistant="trim"` those leading assistant turns are dropped (the
    reply to an unseen question teaches nothing useful); with "skip" such conversations are skipped.
    """
    if leading_assistant not in ("trim", "skip"):
        raise ValueError(f"leading_assistant must be 'trim' or 'skip', got {leading_assistant!r}")
    if not messages:
        return None, "empty_conversation"
    system = [messages[0]] if messages[0]["role"] == "system" else []
    turns = messages[len(system):]
    if any(m["role"] == "system" for m in turns):
        return None, "system_not_first"
    if turns and turns[0]["role"] == "assistant":
        if leading_assistant == "skip":
            return None, "assistant_first"
        while turns and turns[0]["role"] == "assistant":
            turns = turns[1:]
    while turns and turns[-1]["role"] != "assistant":  # a trailing question has no answer to learn from
        turns = turns[:-1]
    if not turns:
        return None, "no_assistant_turn"
    # a turn cut at max_tokens inside its reasoning has no answer text, yet its tokens are what the model generated
    if any(not m["content"].strip() and not m.get("tool_calls") and not m.get("reasoning_content")
           and m["role"] != "tool" for m in system + turns):
        return None, "empty_turn"
    previous = None
    for m in turns:
        # user -> assistant; an assistant that calls tools -> its tool results -> the assistant again
        expected = {None: ("user",), "user": ("assistant",), "tool": ("tool", "assistant"),
                    "assistant": ("tool",) if previous and previous.get("tool_calls") else ("user",)}[
            previous and previous["role"]]
        if m["role"] not in expected:
            return None, "tool_result_without_call" if m["role"] == "tool" else "broken_alternation"
        previous = m
    return system + turns, None
