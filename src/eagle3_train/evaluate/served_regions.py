"""Served acceptance inside a thinking model's reasoning and in its answer, each region measured by a pass of its own.

vLLM's spec-decode counters are server-wide, so a pass over whole replies cannot say where its drafts fell. For each
prompt's first turn, the reasoning pass asks for the reply up to `</think>` (`stop_token_ids`, token ids returned);
the answer pass sends the rendered prompt, that reasoning and `</think>` back as token ids to /completions and lets
the model answer, within what is left of the same max_tokens. Both sample at the whole-reply pass's temperature and
seeds. The reasoning pass holds the rounds that start inside the reasoning (as the offline evaluator counts them);
the answer pass starts its rounds at `</think>`, where a whole reply's first answer round starts wherever the
round that crossed `</think>` ended. Replies cut at max_tokens inside their reasoning have no answer; replies that
end without closing a reasoning (the model answered without thinking) are counted and named, since their tokens sit
in the reasoning pass's figure.

vLLM counts a round's accepted tokens before the stop cuts the reply, so the reasoning pass's counters hold up to k
tokens per reply accepted past `</think>` (highly predictable ones: 8 of 29 on the taught simulated Kimi); each
region's figure is over the tokens its replies returned (`accepted_past_stop`), the raw count kept beside it.

The split needs `</think>` to be one token of the served tokenizer (Kimi, Qwen3, DeepSeek-R1/V3.1); `auto` measures
it there and nowhere else.

Python API: `think_end_id(base_url, model) -> int | None`;
`measure_regions(base_urls, model, messages, seeds, end_id, ...) -> {"by_region": {"reasoning", "answer"}, "replies"}`.
"""

from __future__ import annotations

import asyncio
import json
import logging
import urllib.request
from typing import Any

from eagle3_train.serving.client import ChatPool, ContextTooLongError, RequestRejected
from eagle3_train.serving.metrics import root_url, servers_counters
from eagle3_train.utils.io import Eagle3InputError

log = logging.getLogger(__name__)

THINK_END = "</think>"


def think_end_id(base_url: str, model: str, api_key: str = "EMPTY", timeout_s: float = 30.0) -> int | None:
    """The id of `</think>` in the served tokenizer (vLLM's /tokenize), or None when it is not one token."""
    url = root_url(base_url) + "/tokenize"
    body = json.dumps({"model": model, "prompt": THINK_END, "add_special_tokens": False}).encode()
    headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {api_key}"} if api_key else {})}
    try:
        with urllib.request.urlopen(urllib.request.Request(url, data=body, headers=headers), timeout=timeout_s) as r:
            tokens = json.load(r).get("tokens") or []
    except (OSError, ValueError) as e:
        raise Eagle3InputError(f"cannot tokenize {THINK_END!r} at {url}: {e} (the reasoning split reads vLLM's "
                               f"/tokenize)") from None
    return int(tokens[0]) if len(tokens) == 1 else None


def _reasoning_ids(reply: Any, end_id: int) -> tuple[str, list[int] | None]:
    """How a reasoning-pass reply ended, and the prompt + reasoning + `</think>` ids the answer pass continues."""
    if reply.token_ids is None or reply.prompt_token_ids is None:
        raise Eagle3InputError("the server returned no token ids (vLLM's return_token_ids): the reasoning split "
                               "needs a vLLM server")
    ids = list(reply.token_ids)
    if end_id in ids:
        return "closed", list(reply.prompt_token_ids) + ids[: ids.index(end_id) + 1]
    if reply.stop_reason == end_id:  # vLLM leaves the stop token out of the returned ids
        return "closed", list(reply.prompt_token_ids) + ids + [end_id]
    return ("cut_in_reasoning" if reply.finish_reason == "length" else "without_closing"), None


async def _reasoning_pass(pool: ChatPool, messages: list[list[dict[str, str]]], seeds: list[int | None],
                          end_id: int, max_tokens: int, temperature: float, concurrency: int) -> list[dict[str, Any]]:
    sem = asyncio.Semaphore(concurrency)
    extra = {"stop_token_ids": [end_id], "return_token_ids": True, "spaces_between_special_tokens": False}

    async def one(msgs: list[dict[str, str]], seed: int | None) -> dict[str, Any]:
        async with sem:
            try:
                reply = await pool.chat(msgs, max_tokens=max_tokens, temperature=temperature, seed=seed,
                                        extra_body=extra)
            except (ContextTooLongError, RequestRejected) as e:
                return {"ended": "error", "error": str(e)[:300], "tokens": 0}
            ended, ids = _reasoning_ids(reply, end_id)
            returned = list(reply.token_ids or [])
            # the tokens the server generated: `</think>` too where it left the stop token out of the ids
            tokens = len(returned) + (1 if ended == "closed" and end_id not in returned else 0)
            return {"ended": ended, "ids": ids, "tokens": tokens, "left": max_tokens - len(returned)}

    return list(await asyncio.gather(*(one(m, s) for m, s in zip(messages, seeds))))


async def _answer_pass(pool: ChatPool, thoughts: list[dict[str, Any]], seeds: list[int | None], temperature: float,
                       concurrency: int) -> list[dict[str, Any]]:
    sem = asyncio.Semaphore(concurrency)

    async def one(t: dict[str, Any], seed: int | None) -> dict[str, Any]:
        async with sem:
            try:
                response, _ = await pool.complete_tokens(t["ids"], max_tokens=t["left"], temperature=temperature,
                                                         seed=seed)
            except (ContextTooLongError, RequestRejected) as e:
                return {"error": str(e)[:300], "tokens": 0}
            return {"tokens": int((response.get("usage") or {}).get("completion_tokens") or 0)}

    todo = [(t, s) for t, s in zip(thoughts, seeds) if t["ended"] == "closed" and t["left"] > 0]
    return list(await asyncio.gather(*(one(t, s) for t, s in todo)))


def accepted_past_stop(replies: int, tokens: int, drafts: int, counted: int) -> int:
    """Accepted tokens vLLM counted that no reply returned. Its scheduler counts a round's accepted tokens before
    the stop check cuts the reply there, so a round that crosses `</think>` (or EOS, or max_tokens) counts the tokens
    after it. Every returned token comes from a reply's prefill (one each) or from a round (its accepted tokens plus
    the bonus token): what the counters hold beyond that was cut. A reply with more rounds without drafts only makes
    this smaller (never removes a returned token)."""
    return max(0, replies + drafts + counted - tokens) if drafts else 0


def _region(diff: Any, replies: int, tokens: int) -> dict[str, Any]:
    """One pass's acceptance over the tokens its replies returned: the accepted tokens counted past the stop are
    taken out of the total and, since they end their round, out of the highest positions first."""
    s = diff.summary()
    drafts, counted = s["num_drafts"], s["num_accepted_tokens"]
    past = accepted_past_stop(replies, tokens, drafts, counted)
    per_pos = list(s["num_accepted_tokens_per_pos"])
    left = past
    for i in reversed(range(len(per_pos))):
        cut = min(left, per_pos[i])
        per_pos[i] -= cut
        left -= cut
    accepted = counted - past
    return {"mean_acceptance_length": 1.0 + accepted / drafts if drafts else None,
            "per_position_acceptance": [v / drafts for v in per_pos] if drafts else None,
            "num_drafts": drafts, "num_accepted_tokens": accepted, "num_accepted_counted_by_vllm": counted,
            "num_accepted_past_stop": past, "replies": replies, "generated_tokens": tokens}


def measure_regions(base_urls: list[str], model: str, messages: list[list[dict[str, str]]], seeds: list[int | None],
                    end_id: int, *, max_tokens: int, concurrency: int, temperature: float, api_key: str = "EMPTY",
                    timeout_s: float = 600.0) -> dict[str, Any]:
    """Acceptance in the reasoning and in the answer of each conversation in `messages` (first turns), one pass
    each; run nothing else against the servers meanwhile (their counters are server-wide)."""

    async def passes() -> tuple[list[dict], list[dict], Any, Any, Any]:
        pool = ChatPool(base_urls, model, api_key=api_key, timeout_s=timeout_s)
        try:
            before = servers_counters(base_urls)
            thoughts = await _reasoning_pass(pool, messages, seeds, end_id, max_tokens, temperature, concurrency)
            middle = servers_counters(base_urls)
            answers = await _answer_pass(pool, thoughts, seeds, temperature, concurrency)
            return thoughts, answers, before, middle, servers_counters(base_urls)
        finally:
            await pool.aclose()

    thoughts, answers, before, middle, after = asyncio.run(passes())
    ended = {k: sum(t["ended"] == k for t in thoughts) for k in ("closed", "cut_in_reasoning", "without_closing",
                                                                  "error")}
    result: dict[str, Any] = {"by_region": {
        "reasoning": _region(middle.since(before), len(thoughts) - ended["error"], sum(t["tokens"] for t in thoughts)),
        "answer": _region(after.since(middle), sum("error" not in a for a in answers),
                          sum(a["tokens"] for a in answers))},
        "replies": ended, "turn": 1, "think_end_id": end_id}
    if ended["without_closing"]:
        result["note"] = (f"{ended['without_closing']} of {len(thoughts)} replies ended without closing a reasoning "
                          f"({THINK_END}): their tokens are counted in the reasoning figure")
        log.warning("reasoning split: %s", result["note"])
    return result
