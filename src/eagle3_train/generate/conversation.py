"""One conversation: its assistant turns regenerated in order through the pool, on the model's own earlier answers
(the tool-call turns kept as given), with the tokens counted in `Stats`."""

from __future__ import annotations

import hashlib
import json
import logging
import re
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from eagle3_train.assets.conversation_records import REGENERATED, TOKEN_IDS
from eagle3_train.assets.data_spec import DataSource
from eagle3_train.assets.thinking import GENERIC, ThinkingStyle, resolve_style
from eagle3_train.generate.run_settings import Sampling
from eagle3_train.serving.client import ChatPool, ContextTooLongError, RequestRejected

log = logging.getLogger(__name__)
_THINK = re.compile(r"^\s*<think>(.*?)</think>\s*", re.DOTALL)


@dataclass
class Stats:
    requests: int = 0
    completion_tokens: int = 0
    prompt_tokens: int = 0
    finished: int = 0
    skipped: Counter = field(default_factory=Counter)
    truncated: int = 0
    cut_turns: int = 0  # turns that hit max_tokens (kept or dropped)
    tool_call_turns_kept: int = 0  # assistant turns that called tools, kept as given
    # completion tokens split between reasoning and answer: as the server counted them (vLLM's usage
    # completion_tokens_details.reasoning_tokens), else by their share of the text
    reasoning_tokens: float = 0.0
    answer_tokens: float = 0.0

    @property
    def handled(self) -> int:
        """Conversations this run finished or skipped."""
        return self.finished + sum(self.skipped.values())


def split_inline_reasoning(content: str) -> tuple[str, str | None]:
    """(answer, reasoning) of a reply whose reasoning is inline (`<think>...</think>`: a server without a reasoning
    parser); a reply cut inside its reasoning (no `</think>`) is all reasoning."""
    match = _THINK.match(content)
    if match:
        return content[match.end():], match.group(1).strip("\n")
    stripped = content.lstrip()
    if stripped.startswith("<think>"):
        return "", stripped[len("<think>"):].strip("\n")
    return content, None


def request_seed(seed: int | None, conv_id: str, turn: int) -> int | None:
    if seed is None:
        return None
    digest = hashlib.sha256(f"{seed}:{conv_id}:{turn}".encode()).digest()
    return int.from_bytes(digest[:4], "big") & 0x7FFFFFFF


def _normalize(messages: list[dict[str, str]]) -> tuple[list[dict[str, str]] | None, str | None]:
    from eagle3_train.assets.conversation_records import normalize_turns

    return normalize_turns(messages)


async def regenerate_conversation(pool: ChatPool, conv_id: str, messages: list[dict[str, str]],
                                  sampling: Sampling, stats: Stats, style: ThinkingStyle = GENERIC,
                                  tools: list[dict[str, Any]] | None = None) -> tuple[dict | None, dict | None]:
    """Regenerate one conversation; returns (record, None) or (None, skip record). `tools`: the conversation's
    functions, sent with every request (so the template renders them as prepare will, and a new call comes back as
    `tool_calls` from a server with a tool-call parser) and kept in the record."""
    msgs, reason = _normalize(messages)
    if reason:
        return None, {"id": conv_id, "reason": reason, "detail": ""}
    # The text exactly as generated: vLLM (and SGLang) otherwise put a space on both sides of every special token when
    # they detokenize with a remote-code (slow) tokenizer such as Kimi's, so a reply would come back as
    # "  thought" / " answer" and train on tokens the model never produced (measured on the simulated Kimi).
    # return_token_ids: vLLM's completion token ids, kept so that prepare can compare what it supervises with them
    extra = {"spaces_between_special_tokens": False, "return_token_ids": True,
             **(style.request_extra(sampling.reasoning) or {})}
    out: list[dict[str, Any]] = []
    turns: list[dict[str, Any]] = []
    prefer: int | None = None  # keep a conversation on one endpoint: its prefix cache holds the earlier turns
    truncated = None
    for m in msgs:
        if m["role"] != "assistant" or m.get("tool_calls"):
            # an assistant turn that called tools is kept as given: the recorded tool results answer that call;
            # the verifier did not produce it, so prepare does not supervise it (unless asked)
            out.append({**m, REGENERATED: False} if m["role"] == "assistant" else dict(m))
            if m["role"] == "assistant":
                turns.append({"kept": "tool_calls"})
                stats.tool_call_turns_kept += 1
            continue
        history = openai_history(out)
        try:
            reply = await pool.chat(history, prefer=prefer, max_tokens=sampling.max_tokens,
                                    temperature=sampling.temperature, top_p=sampling.top_p,
                                    seed=request_seed(sampling.seed, conv_id, len(turns)), extra_body=extra,
                                    tools=tools)
        except ContextTooLongError as e:
            if not turns:
                return None, {"id": conv_id, "reason": "context_too_long", "detail": str(e)[:300]}
            truncated = "context_too_long"
            break
        except RequestRejected as e:
            return None, {"id": conv_id, "reason": e.reason, "detail": str(e)[:300]}
        prefer = reply.endpoint
        stats.requests += 1
        tokens = int(reply.usage.get("completion_tokens", 0))
        stats.completion_tokens += tokens
        stats.prompt_tokens += int(reply.usage.get("prompt_tokens", 0))
        content, reasoning = reply.content, reply.reasoning
        if reasoning is None:  # a server without a reasoning parser leaves <think> inline
            content, reasoning = split_inline_reasoning(content)
        _count_text(stats, tokens, reasoning or "", content,
                    (reply.usage.get("completion_tokens_details") or {}).get("reasoning_tokens"))
        stripped = bool(reasoning) and sampling.reasoning != "keep"  # generated reasoning that is not trained
        if sampling.reasoning != "keep":
            reasoning = None
        cut = reply.finish_reason == "length"
        stats.cut_turns += cut
        if cut and sampling.truncated_turns == "drop":
            return None, {"id": conv_id, "reason": "max_tokens",
                          "detail": f"turn {len(turns)} reached max_tokens {sampling.max_tokens}"}
        msg: dict[str, Any] = {"role": "assistant", "content": content}
        if reasoning:
            msg["reasoning_content"] = reasoning
        if reply.tool_calls:
            msg["tool_calls"] = reply.tool_calls
        if reply.token_ids is not None and not stripped:
            msg[TOKEN_IDS] = list(reply.token_ids)  # (not where the reasoning was stripped: other text is trained)
        out.append(msg)
        turns.append({"finish_reason": reply.finish_reason, "usage": reply.usage})
        if cut:  # the next question would follow an unfinished answer
            truncated = "max_tokens"
            break
        if reply.tool_calls:  # a new call has no recorded result: the trace ends with it (it is on-policy)
            truncated = "tool_call_without_result"
            break
    while out and out[-1]["role"] != "assistant":  # the question whose answer did not fit
        out.pop()
    record: dict[str, Any] = {"id": conv_id, "messages": out, "turns": turns, "model": pool.model,
                              **({"tools": tools} if tools else {})}
    if truncated:
        record["truncated"] = truncated
    return record, None


def tool_server_args(source: DataSource, model_name: str, model_dir: str | Path | None, thinking_style: str = "auto",
                     limit: int | None = None, skip_bad_records: bool = False) -> list[str]:
    """vLLM flags for a server started here to regenerate `source`: the family's tool-call parser when its
    conversations offer tools (without one, vLLM refuses every request that carries them), else none."""
    from eagle3_train.assets.conversations import load_conversations

    conversations, _ = load_conversations(source, limit=limit, skip_bad_records=skip_bad_records)
    if not any(c.tools for c in conversations):
        return []
    style, _ = resolve_style(thinking_style, model_name, model_dir)
    if not style.tool_server_args():
        log.warning("the conversations offer tools, but no tool-call parser is known for %s (style %s): pass "
                    "--vllm-arg=--enable-auto-tool-choice --vllm-arg=--tool-call-parser=NAME", model_name, style.name)
    return style.tool_server_args()


def openai_history(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Messages as an OpenAI chat request takes them: tool-call arguments as JSON text, every tool result naming its
    call (a ShareGPT `observation` answers the calls before it in order), and each turn's reasoning: the template
    decides what of it to render (Kimi's and Qwen3's keep the thinking of the tool-call turns after the last user
    turn), so every turn is generated from the prompt that `prepare` renders for it."""
    out: list[dict[str, Any]] = []
    pending: list[str] = []  # ids of the calls not yet answered
    for m in messages:
        msg: dict[str, Any] = {"role": m["role"], "content": m["content"]}
        if m.get("reasoning_content"):  # vLLM (0.32 checked) hands it to the template as `reasoning`
            msg["reasoning_content"] = m["reasoning_content"]
        if m.get("tool_calls"):
            msg["tool_calls"] = [{**c, "function": {**c["function"], "arguments": c["function"]["arguments"]
                                                    if isinstance(c["function"]["arguments"], str)
                                                    else json.dumps(c["function"]["arguments"])}}
                                 for c in m["tool_calls"]]
            pending = [c["id"] for c in m["tool_calls"]]
        if m["role"] == "tool":
            call_id = m.get("tool_call_id") or (pending[0] if pending else "call_0")
            msg["tool_call_id"] = call_id
            pending = [p for p in pending if p != call_id]
        out.append(msg)
    return out


def _count_text(stats: Stats, tokens: int, reasoning: str, answer: str, counted: int | None = None) -> None:
    total = len(reasoning) + len(answer)
    share = len(reasoning) / total if total else 0.0
    if counted is not None and tokens:
        share = min(1.0, int(counted) / tokens)
    stats.reasoning_tokens += tokens * share
    stats.answer_tokens += tokens * (1 - share)
