"""Where a thinking model's reasoning goes in a training sample.

`generate` keeps the verifier's reasoning as `reasoning_content` beside the answer (as vLLM/SGLang reasoning parsers
return it). The draft must learn those tokens too: a thinking model spends most of its generation on them. Modes:
- `template`: pass `reasoning_content` to the chat template (Qwen3, Kimi, DeepSeek templates render it, usually only
  for the last assistant turn, as the model sees it when serving);
- `inline`: put it back into the content as `<think>\\n...\\n</think>\\n\\n` + answer (the token stream the model
  generated before the server's parser split it off), for templates that ignore `reasoning_content`;
- `auto` (default): `template` when the template renders `reasoning_content`, else `inline`;
- `drop`: train on the answers only.
Reasoning is part of the assistant turn, so its tokens are supervised like the answer's.

Templates that render reasoning only after the last user turn (Kimi, Qwen3) would drop every earlier turn's reasoning
from a multi-turn conversation. Such a conversation is split at its user turns (`split_at_user_turns`): sample j ends
before user turn j+1 and supervises only the assistant turns after user turn j (their reasoning rendered, as the model
generated it), the earlier turns rendered as the template renders history (as the model reads them when serving).
Every turn's reasoning is then supervised once.
"""

from __future__ import annotations

from typing import Any, get_args

from eagle3_train.data.chat_mask import UNSUPERVISED
from eagle3_train.settings import ReasoningPlacement
from eagle3_train.utils.io import Eagle3InputError

REASONING_MODES = get_args(ReasoningPlacement)
REASONING_KEY = "reasoning_content"


def check_reasoning_mode(mode: str) -> None:
    if mode not in REASONING_MODES:
        raise Eagle3InputError(f"reasoning must be one of {REASONING_MODES}, got {mode!r}")


def resolve_mode(mode: str, template_renders_reasoning: bool) -> str:
    check_reasoning_mode(mode)
    if mode == "auto":
        return "template" if template_renders_reasoning else "inline"
    return mode


def place_reasoning(messages: list[dict[str, Any]], mode: str) -> list[dict[str, Any]]:
    """Messages with each assistant turn's reasoning placed per the (resolved) mode."""
    out = []
    for m in messages:
        reasoning = m.get(REASONING_KEY)
        if not reasoning or mode == "template":
            out.append(m)
            continue
        m = {k: v for k, v in m.items() if k != REASONING_KEY}
        if mode == "inline":
            m["content"] = f"<think>\n{reasoning}\n</think>\n\n{m['content']}"
        out.append(m)
    return out


def split_at_user_turns(messages: list[dict[str, Any]]) -> list[list[dict[str, Any]]]:
    """One sample per user turn that has an answer: the conversation up to the next user turn, with the assistant
    turns before this user turn marked as unsupervised context. A conversation whose only reasoning is after its
    last user turn is returned whole."""
    users = [i for i, m in enumerate(messages) if m["role"] == "user"]
    if not users or not any(m.get(REASONING_KEY) for m in messages[: users[-1]] if m["role"] == "assistant"):
        return [messages]
    samples = []
    for j, u in enumerate(users):
        end = users[j + 1] if j + 1 < len(users) else len(messages)
        if not any(m["role"] == "assistant" for m in messages[u:end]):
            continue
        samples.append([{**m, UNSUPERVISED: True} if m["role"] == "assistant" and i < u else m
                        for i, m in enumerate(messages[:end])])
    return samples
