"""The column shapes a conversation record comes in, and which one a record (a file's record, a dataset's row) has.

Turn lists: `conversations` or `messages`, their turns `from`/`value` (ShareGPT) or `role`/`content` (OpenAI), either
list with either kind of turn: speculators and SpecForge write `conversations` with role/content. Column pairs: one
user turn and its answer, from the first pair of `PAIRS` a record has (`instruction` takes Alpaca's `input` after it
when that is not empty); a `prompt`/`completion` pair of message lists (TRL's conversational form) is their turns in
order. Beside the shape, a record's `id`, top-level `system` prompt and `tools` are read; its other fields are not.

Python API: `shape_of(record) -> Shape | None`, `pair_turns(record, shape, where) -> turns`, `kept_fields(record,
shape) -> dict`, `SHAPES_TEXT` (the shapes, for messages and docs).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from eagle3_train.utils.io import Eagle3InputError

TURN_LISTS = ("conversations", "messages")
SHAREGPT_KEYS, OPENAI_KEYS = ("from", "value"), ("role", "content")
# (user turn, answer) column pairs, the first a record has wins: `instruction` before `input` (Alpaca has all three)
PAIRS: tuple[tuple[str, str], ...] = (
    ("prompt", "response"), ("prompt", "completion"), ("instruction", "output"), ("instruction", "response"),
    ("question", "answer"), ("problem", "solution"), ("query", "response"), ("input", "output"))
ALPACA_INPUT = "input"  # appended to an `instruction` when the record has it (and it is not empty)
OWN_FIELDS = ("id", "system", "tools")  # read beside any shape
SHAPES_TEXT = ("'conversations' or 'messages' (turns of from/value or role/content), or a column pair: "
               + ", ".join(f"{u}/{a}" for u, a in PAIRS) + " (instruction with an optional input)")


@dataclass(frozen=True)
class Shape:
    name: str  # "sharegpt" (from/value turns), "messages" (role/content turns) or the pair, e.g. "question/answer"
    fields: tuple[str, ...]  # the record fields holding the conversation
    turn_keys: tuple[str, str] = OPENAI_KEYS  # a turn's role and content keys

    @property
    def list_key(self) -> str | None:
        return self.fields[0] if self.fields[0] in TURN_LISTS else None


def _present(record: dict[str, Any], key: str) -> bool:
    return record.get(key) is not None  # a dataset row has every column, None where a row has no value


def shape_of(record: dict[str, Any]) -> Shape | None:
    """The shape `record` has; None when it has none of them."""
    list_key = next((k for k in TURN_LISTS if _present(record, k)), None)
    if list_key is not None:
        turns = record[list_key]
        first = next((t for t in turns if isinstance(t, dict)), None) if isinstance(turns, list) else None
        if first is not None:
            sharegpt = any(k in first for k in SHAREGPT_KEYS) and not any(k in first for k in OPENAI_KEYS)
        else:  # nothing to tell by: the list's usual kind (its errors then name the keys expected)
            sharegpt = list_key == "conversations"
        keys = SHAREGPT_KEYS if sharegpt else OPENAI_KEYS
        return Shape("sharegpt" if sharegpt else "messages", (list_key,), keys)
    for user, answer in PAIRS:
        if _present(record, user) and _present(record, answer):
            extra = (ALPACA_INPUT,) if user == "instruction" and _present(record, ALPACA_INPUT) else ()
            return Shape(f"{user}/{answer}", (user, answer, *extra))
    return None


def pair_turns(record: dict[str, Any], shape: Shape, where: str) -> list[dict[str, Any]]:
    """A column pair's turns, role/content: the user turn (with Alpaca's input) and the answer."""
    user, answer, *extra = shape.fields
    if isinstance(record[user], list) and isinstance(record[answer], list):  # prompt/completion as message lists
        return [*record[user], *record[answer]]
    for key in shape.fields:
        if not isinstance(record[key], str):
            raise Eagle3InputError(f"{where}: field '{key}' must be text (a {shape.name} record), got "
                                   f"{type(record[key]).__name__}")
    question = record[user]
    if extra and record[extra[0]].strip():
        question = f"{question}\n\n{record[extra[0]]}"
    return [{"role": "user", "content": question}, {"role": "assistant", "content": record[answer]}]


def kept_fields(record: dict[str, Any], shape: Shape) -> dict[str, Any]:
    """The fields of `record` a conversation is read from (its shape's, and its own id, system prompt and tools)."""
    return {k: record[k] for k in (*OWN_FIELDS, *shape.fields) if _present(record, k)}
