"""A run's settings: what shapes the text (`Sampling`, checked on resume), how it runs (`Run`), and the ones left to
the servers (the model served, the thinking style and max_tokens, the requests in flight), settled before the first
request."""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from typing import Any

from eagle3_train.assets.thinking import GENERIC, ThinkingStyle, resolve_style
from eagle3_train.serving.client import ChatPool, EndpointUnavailable, FatalRequestError
from eagle3_train.settings import GenerateSettings
from eagle3_train.utils.io import Eagle3InputError

log = logging.getLogger(__name__)

_D = GenerateSettings  # the dataclass defaults below are the settings dataclass's


DEFAULT_MAX_TOKENS = 512  # an answer without thinking
THINKING_MAX_TOKENS = 32768  # at most, when derived from the server's context
THINKING_MAX_TOKENS_UNKNOWN = 16384  # when the server does not say its max_model_len


@dataclass
class Sampling:
    """What shapes the regenerated text: a resume under other values is refused."""
    max_tokens: int = DEFAULT_MAX_TOKENS
    temperature: float = _D.temperature
    top_p: float = _D.top_p
    seed: int | None = _D.seed
    reasoning: str = _D.reasoning  # keep (as reasoning_content), strip, or disable (the style's switch)
    thinking_style: str = "generic"  # resolved (assets/thinking.py)
    truncated_turns: str = _D.truncated_turns  # keep or drop a conversation whose turn hit max_tokens


@dataclass
class Run:
    """How this invocation runs (none of it changes the text generated)."""
    concurrency: int | None  # None: from the servers (`resolve_concurrency`)
    timeout_s: float
    max_retries: int
    api_key: str
    overwrite: bool
    extra_manifest: dict
    skip_bad_records: bool
    thinking_style: str
    estimate_only: bool


def default_max_tokens(style: ThinkingStyle, reasoning: str, max_model_len: int | None) -> tuple[int, str]:
    """(max new tokens per turn, why) when the user set none: a thinking model's reasoning needs thousands."""
    if style.name == GENERIC.name or reasoning == "disable":
        return DEFAULT_MAX_TOKENS, "default without thinking"
    if max_model_len:
        return min(max_model_len // 2, THINKING_MAX_TOKENS), f"half the server's max_model_len {max_model_len}"
    return THINKING_MAX_TOKENS_UNKNOWN, "thinking default (the server did not say its max_model_len)"


PROMPT_TOKENS_GUESS = 1024  # a request's prompt, for sizing concurrency by the KV cache
MAX_IN_FLIGHT_PER_SERVER = 256  # vLLM's usual max_num_seqs: more would only queue


async def resolve_concurrency(pool: ChatPool, run: Run, max_tokens: int) -> dict[str, Any]:
    """Set `run.concurrency` when unset: per endpoint, the requests its KV cache holds at `max_tokens` new tokens
    (vLLM's `cache_config_info`), at most MAX_IN_FLIGHT_PER_SERVER; CONCURRENCY for one that does not say."""
    if run.concurrency is not None:
        return {"setting": run.concurrency}
    from eagle3_train.serving.metrics import fetch_metrics, kv_cache_tokens, parse_prometheus
    from eagle3_train.settings import CONCURRENCY

    per: dict[str, Any] = {}
    for ep in pool.endpoints:
        try:
            tokens = kv_cache_tokens(parse_prometheus(await asyncio.to_thread(fetch_metrics, ep.url, 10.0)))
        except (Eagle3InputError, ValueError):
            tokens = None
        n = CONCURRENCY if tokens is None else max(1, min(MAX_IN_FLIGHT_PER_SERVER,
                                                          tokens // (max_tokens + PROMPT_TOKENS_GUESS)))
        per[ep.url] = {"kv_cache_tokens": tokens, "in_flight": n}
    run.concurrency = sum(p["in_flight"] for p in per.values())
    log.info("generate: %d conversations in flight (%s)", run.concurrency,
             ", ".join(f"{u}: {p['in_flight']}" + (f" of {p['kv_cache_tokens']} KV tokens" if p["kv_cache_tokens"]
                                                    else " (no KV size reported)") for u, p in per.items()))
    return {"endpoints": per}


def resolve_thinking(pool: ChatPool, model: str, sampling: Sampling, setting: str) -> tuple[ThinkingStyle, dict]:
    """Resolve the thinking style and (when unset) max_tokens in `sampling`; the manifest's `thinking` record."""
    card = pool.model_card
    try:
        style, found_by = resolve_style(setting, model, card.get("root"))
    except ValueError as e:
        raise Eagle3InputError(str(e)) from None
    sampling.thinking_style = style.name
    why = "setting"
    if not sampling.max_tokens:
        sampling.max_tokens, why = default_max_tokens(style, sampling.reasoning, card.get("max_model_len"))
    recommended = style.recommended(sampling.reasoning)
    if recommended and (sampling.temperature, sampling.top_p) != (recommended.temperature, recommended.top_p):
        log.warning("generate: sampling at temperature %s, top_p %s; %s is served at temperature %s, top_p %s "
                    "(%s): drafts should learn what the model says when served", sampling.temperature,
                    sampling.top_p, style.name, recommended.temperature, recommended.top_p, style.source)
    return style, {"style": style.name, "found_by": found_by, "request_extra": style.request_extra(sampling.reasoning),
                   "recommended_sampling": recommended.to_dict() if recommended else None,
                   "max_tokens": sampling.max_tokens, "max_tokens_from": why,
                   "server_max_model_len": card.get("max_model_len")}


async def served_model(pool: ChatPool, model: str | None) -> str:
    """The model to ask for (the only one served when not named), checked against the endpoints."""
    if not model:
        pool.model = model = await _resolve_model(pool)
    try:
        await pool.check_model()
    except (FatalRequestError, EndpointUnavailable) as e:
        raise Eagle3InputError(str(e)) from None
    return model


async def _resolve_model(pool: ChatPool) -> str:
    try:
        return await pool.only_model()
    except (EndpointUnavailable, FatalRequestError) as e:
        raise Eagle3InputError(f"{e} (or pass --model)") from None
