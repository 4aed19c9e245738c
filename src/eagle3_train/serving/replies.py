"""What we read of an OpenAI-compatible server's replies, as schemas: every reply is parsed here, and one that is
not JSON, too large for what was asked, or of the wrong shape is a `MalformedReply` naming the reason (counted and
skipped by the caller), never a traceback and never a Python repr in the training data.

`read_body(chunks, limit)` reads a body up to `limit` bytes; `chat_reply(body)`, `completion_reply(body)` and
`model_ids(body)` validate it; `reply_limit(max_tokens, prompt_chars)` is the size bound a request allows.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

from pydantic import BaseModel, ConfigDict, StrictInt, StrictStr, ValidationError, field_validator

# Per generated token: its text JSON-escaped (6 bytes a character at worst), its id, logprob-free vLLM extras; plus a
# fixed allowance for the envelope. A reply 10x over what its max_tokens can produce is not a reply to this request.
_BYTES_PER_TOKEN = 512
_BYTES_PER_PROMPT_CHAR = 16  # vLLM's return_token_ids echoes the prompt's ids: at most one per character
_ENVELOPE_BYTES = 1 << 20


class MalformedReply(Exception):
    """The server answered, but not with a reply we can use: `reason` is one word for the count."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(f"malformed reply ({reason}): {detail}")
        self.reason = reason


def reply_limit(max_tokens: int, prompt_chars: int = 0) -> int:
    return _ENVELOPE_BYTES + _BYTES_PER_TOKEN * max(int(max_tokens), 1) + _BYTES_PER_PROMPT_CHAR * prompt_chars


async def read_body(chunks: AsyncIterator[bytes], limit: int) -> bytes:
    """The body, read no further than `limit` bytes."""
    parts, size = [], 0
    async for chunk in chunks:
        size += len(chunk)
        if size > limit:
            raise MalformedReply("too_large", f"the body passed {limit} bytes, more than the request can produce")
        parts.append(chunk)
    return b"".join(parts)


class _Model(BaseModel):
    model_config = ConfigDict(extra="allow")


class _Function(_Model):
    name: StrictStr
    arguments: StrictStr


class _ToolCall(_Model):
    id: StrictStr | None = None
    type: StrictStr | None = "function"
    function: _Function


class _Message(_Model):
    content: StrictStr | None = None
    reasoning_content: StrictStr | None = None
    reasoning: StrictStr | None = None
    tool_calls: list[_ToolCall] | None = None


class _Usage(_Model):
    prompt_tokens: StrictInt = 0
    completion_tokens: StrictInt = 0
    total_tokens: StrictInt | None = None
    completion_tokens_details: dict[str, StrictInt | None] | None = None


class _ChatChoice(_Model):
    message: _Message
    finish_reason: StrictStr | None = None
    token_ids: list[StrictInt] | None = None
    stop_reason: StrictInt | StrictStr | None = None


def _not_empty(v: list) -> list:
    if not v:
        raise ValueError("no choices")
    return v


class ChatBody(_Model):
    choices: list[_ChatChoice]
    usage: _Usage | None = None
    prompt_token_ids: list[StrictInt] | None = None
    _check_choices = field_validator("choices")(_not_empty)


class _CompletionChoice(_Model):
    text: StrictStr | None = None
    finish_reason: StrictStr | None = None
    prompt_token_ids: list[StrictInt] | None = None
    token_ids: list[StrictInt] | None = None


class _KVTransfer(_Model):
    hidden_states_path: StrictStr | None = None


class CompletionBody(_Model):
    choices: list[_CompletionChoice]
    usage: _Usage | None = None
    kv_transfer_params: _KVTransfer | None = None
    _check_choices = field_validator("choices")(_not_empty)


class _Card(_Model):
    id: StrictStr
    root: StrictStr | None = None
    max_model_len: StrictInt | None = None


class ModelList(_Model):
    data: list[_Card]


def _parse(body: bytes, schema: type[BaseModel]) -> Any:
    try:
        raw = json.loads(body)
    except (UnicodeDecodeError, ValueError):
        start = body[:80].decode("utf-8", "replace")
        raise MalformedReply("not_json", f"the body is not JSON (starts {start!r})") from None
    try:
        return schema.model_validate(raw)
    except ValidationError as e:
        first = e.errors()[0]
        where = ".".join(map(str, first["loc"])) or "the body"
        raise MalformedReply("wrong_shape", f"{where}: {first['msg']} (got {str(first.get('input'))[:60]!r})") \
            from None


def chat_reply(body: bytes) -> ChatBody:
    return _parse(body, ChatBody)


def completion_reply(body: bytes) -> dict[str, Any]:
    """The validated reply as a plain dict (callers read `choices`, `usage`, `kv_transfer_params`)."""
    return _parse(body, CompletionBody).model_dump()


def model_cards(body: bytes) -> list[dict[str, Any]]:
    return [c.model_dump() for c in _parse(body, ModelList).data]
