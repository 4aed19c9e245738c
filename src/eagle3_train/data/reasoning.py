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
"""

from __future__ import annotations

from typing import Any, get_args

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
