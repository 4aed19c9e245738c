"""Chat completions against one or more OpenAI-compatible endpoints, with retries and error classes that tell the
caller what to do: retry (connection errors, timeouts, 429, 5xx — handled here with exponential backoff), skip the
sample (`ContextTooLongError`, `RequestRejected`) or stop the whole run (`FatalRequestError`, `EndpointUnavailable`).

Python API: `ChatPool(endpoints, model, ...)`; `await pool.check_model()`; `await pool.chat(messages, **sampling)
-> ChatReply`; `await pool.complete_tokens(token_ids, max_tokens=1, extra_body=...) -> (response dict, endpoint)`;
`await pool.only_model()`; `await pool.aclose()`.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from dataclasses import dataclass, field
from typing import Any

import openai

from eagle3_train.serving.replies import (
    MalformedReply,
    chat_reply,
    completion_reply,
    model_cards,
    read_body,
    reply_limit,
)

log = logging.getLogger(__name__)

# Phrases vLLM (and other OpenAI-compatible servers) use when prompt + output exceed the model's context.
_CONTEXT_PHRASES = ("maximum context length", "context length", "context_length", "too long",
                    "reduce the length", "max_model_len")


def quiet_http_logs() -> None:
    """The HTTP client logs every request at INFO; keep that for --verbose (root logger at DEBUG) only."""
    if logging.getLogger().getEffectiveLevel() > logging.DEBUG:
        for name in ("httpx", "httpx2", "openai"):
            logging.getLogger(name).setLevel(logging.WARNING)


class FatalRequestError(RuntimeError):
    """A request failed in a way no retry or other sample will fix (wrong model name, authentication)."""


class EndpointUnavailable(RuntimeError):
    """All retries failed (server down or repeatedly failing); the run stops and can be resumed."""


class ContextTooLongError(Exception):
    """The conversation does not fit the server's context: this sample is skipped."""


class RequestRejected(Exception):
    """The server rejected this request (4xx other than the above), or answered it with a malformed reply
    (`reason` says which): this sample is skipped."""

    reason = "rejected"


@dataclass
class ChatReply:
    content: str
    reasoning: str | None
    finish_reason: str | None
    usage: dict[str, int]
    endpoint: int
    latency_s: float
    tool_calls: list[dict[str, Any]] | None = None  # parsed by the server's tool-call parser, when it has one
    # vLLM's `return_token_ids`: the rendered prompt and the generated tokens as ids (None when not asked or not sent)
    prompt_token_ids: list[int] | None = None
    token_ids: list[int] | None = None
    stop_reason: int | str | None = None  # vLLM: the stop token id or string that ended the reply


@dataclass
class _Endpoint:
    url: str
    client: openai.AsyncOpenAI
    in_flight: int = 0
    failures: int = 0
    extra: dict[str, Any] = field(default_factory=dict)


def _error_text(e: openai.APIStatusError) -> str:
    body = e.body
    if isinstance(body, dict):
        inner = body.get("error", body)
        if isinstance(inner, dict) and inner.get("message"):
            return str(inner["message"])
        if isinstance(body.get("message"), str):
            return body["message"]
    return str(e.message or e)


def is_context_error(status: int, text: str) -> bool:
    low = text.lower()
    return status in (400, 413, 422) and any(p in low for p in _CONTEXT_PHRASES)


class _Deadline(Exception):
    """The whole request (not one socket read) took longer than the client's timeout: a server trickling its
    reply holds no slot past it. Retried like any timeout."""


class ChatPool:
    """Spreads requests over several endpoints serving the same model (the least busy one first; at equal load,
    endpoint `first` modulo their number, then the following ones: pools in several processes start apart)."""

    def __init__(self, endpoints: list[str], model: str, *, api_key: str = "EMPTY", timeout_s: float = 600.0,
                 max_retries: int = 6, backoff_s: float = 1.0, backoff_max_s: float = 60.0, first: int = 0) -> None:
        if not endpoints:
            raise ValueError("at least one endpoint is needed")
        self.model = model
        self.max_retries = max_retries
        self.backoff_s = backoff_s
        self.backoff_max_s = backoff_max_s
        self.timeout_s = timeout_s
        self.endpoints = [
            _Endpoint(url=u.rstrip("/"), client=openai.AsyncOpenAI(base_url=u.rstrip("/"), api_key=api_key,
                                                                   timeout=timeout_s, max_retries=0))
            for u in endpoints]
        self.retries = 0
        # the served model's card from /v1/models (vLLM: `root`, its path or hub id, and `max_model_len`)
        self.model_card: dict[str, Any] = {}
        self.first = first

    async def aclose(self) -> None:
        for ep in self.endpoints:
            await ep.client.close()

    async def check_model(self) -> None:
        """Fail early and clearly when an endpoint is unreachable or does not serve `self.model`."""
        attempts = max(1, min(5, self.max_retries + 1))
        for ep in self.endpoints:
            for attempt in range(attempts):
                try:
                    cards = await self.model_cards(ep)
                    models = [m["id"] for m in cards]
                    self.model_card = self.model_card or next(
                        ({"root": m["root"], "max_model_len": m["max_model_len"]} for m in cards
                         if m["id"] == self.model), {})
                    break
                except MalformedReply as e:
                    raise FatalRequestError(f"{ep.url}/models: {e}; is it an OpenAI-compatible server?") from None
                except openai.APIConnectionError as e:
                    if attempt == attempts - 1:
                        raise EndpointUnavailable(f"cannot reach {ep.url}: {e}. Is the server running? "
                                                  f"(`eagle3-train serve --verifier NAME --port P`)") from None
                    await asyncio.sleep(min(self.backoff_s * 2 ** attempt, self.backoff_max_s))
                except openai.APIStatusError as e:
                    if e.status_code in (404, 405):  # some servers have no /models: let the first request decide
                        models = None
                        break
                    raise FatalRequestError(f"{ep.url}/models answered {e.status_code}: {_error_text(e)}") from None
            if models is not None and self.model not in models:
                raise FatalRequestError(f"{ep.url} does not serve model {self.model!r}; it serves {models}. "
                                        f"Pass one of these with --model.")

    def _pick(self, prefer: int | None, avoid: int | None) -> int:
        if prefer is not None and prefer != avoid:
            return prefer
        n = len(self.endpoints)
        order = sorted(range(n), key=lambda i: (i == avoid, self.endpoints[i].in_flight, self.endpoints[i].failures,
                                                (i - self.first) % n))
        return order[0]

    async def only_model(self) -> str:
        """The name of the one model the first endpoint serves (for callers given no model name)."""
        ep = self.endpoints[0]
        try:
            models = [m["id"] for m in await self.model_cards(ep)]
        except Exception as e:  # noqa: BLE001 - reported as one clear error
            raise EndpointUnavailable(f"cannot list the models of {ep.url} ({e}); is the server running?") from None
        if len(models) != 1:
            raise FatalRequestError(f"{ep.url} serves {models}; choose one with --model")
        return models[0]

    async def chat(self, messages: list[dict[str, Any]], *, prefer: int | None = None, max_tokens: int = 512,
                   temperature: float = 0.0, top_p: float = 1.0, seed: int | None = None,
                   extra_body: dict[str, Any] | None = None, tools: list[dict[str, Any]] | None = None) -> ChatReply:
        """One chat completion; retries transient failures with exponential backoff (jittered). `tools`: the
        functions the model may call (the server needs a tool-call parser to return its calls as `tool_calls`)."""
        kwargs: dict[str, Any] = {"model": self.model, "messages": messages, "max_tokens": max_tokens,
                                  "temperature": temperature, "top_p": top_p}
        if seed is not None:
            kwargs["seed"] = seed
        if tools:
            kwargs["tools"] = tools
        if extra_body:
            kwargs["extra_body"] = extra_body

        limit = reply_limit(max_tokens, sum(len(str(m.get("content") or "")) + len(str(m.get("reasoning_content")
                                                                                         or "")) for m in messages))

        async def send(ep: _Endpoint, i: int, t0: float) -> ChatReply:
            r = chat_reply(await self._body(ep.client.chat.completions.with_streaming_response.create(**kwargs),
                                            limit))
            choice, usage = r.choices[0], r.usage.model_dump(exclude_none=True) if r.usage else {}
            message = choice.message
            calls = [c.model_dump(include={"id", "type", "function"}) for c in message.tool_calls or []]
            return ChatReply(content=message.content or "", reasoning=message.reasoning_content or message.reasoning,
                             finish_reason=choice.finish_reason, usage=usage, endpoint=i,
                             latency_s=time.monotonic() - t0, tool_calls=calls or None,
                             prompt_token_ids=r.prompt_token_ids, token_ids=choice.token_ids,
                             stop_reason=choice.stop_reason)

        return await self._with_retries(send, prefer)

    async def _body(self, response: Any, limit: int) -> bytes:
        """The body of a streamed response, read up to `limit` bytes within the total deadline."""
        try:
            async with asyncio.timeout(self.timeout_s):
                async with response as r:
                    return await read_body(r.iter_bytes(), limit)
        except TimeoutError:
            raise _Deadline(f"no complete reply within {self.timeout_s:g} s") from None

    async def model_cards(self, ep: _Endpoint) -> list[dict[str, Any]]:
        return model_cards(await self._body(ep.client.models.with_streaming_response.list(), reply_limit(1 << 12)))

    async def complete_tokens(self, prompt_token_ids: list[int], *, prefer: int | None = None, max_tokens: int = 1,
                              temperature: float = 0.0, seed: int | None = None,
                              extra_body: dict[str, Any] | None = None) -> tuple[dict[str, Any], int]:
        """One /completions request whose prompt is token ids (the server does not tokenize); returns the whole
        response as a dict (with server-specific fields such as vLLM's `kv_transfer_params`) and the endpoint used."""
        sampling: dict[str, Any] = {"temperature": temperature, **({"seed": seed} if seed is not None else {})}

        limit = reply_limit(max_tokens, 2 * len(prompt_token_ids))

        async def send(ep: _Endpoint, i: int, t0: float) -> tuple[dict[str, Any], int]:
            r = ep.client.completions.with_streaming_response.create(
                model=self.model, prompt=prompt_token_ids, max_tokens=max_tokens, extra_body=extra_body or None,
                **sampling)
            return completion_reply(await self._body(r, limit)), i

        return await self._with_retries(send, prefer)

    async def _with_retries(self, send: Any, prefer: int | None) -> Any:
        """`await send(endpoint, index, t0)` on the least busy endpoint; transient failures are retried elsewhere
        with exponential backoff (jittered), others raise the error class that says what to do."""
        avoid: int | None = None
        for attempt in range(self.max_retries + 1):
            dropped = False  # a connection that broke on the first try is retried at once (a proxy or LB dropped it)
            i = self._pick(prefer if attempt == 0 else None, avoid)
            ep = self.endpoints[i]
            ep.in_flight += 1
            try:
                result = await send(ep, i, time.monotonic())
                ep.failures = 0
                return result
            except MalformedReply as e:
                rejected = RequestRejected(f"{ep.url}: {e}")
                rejected.reason = f"reply_{e.reason}"
                raise rejected from None
            except openai.APIStatusError as e:
                status, text = e.status_code, _error_text(e)
                if status in (401, 403):
                    raise FatalRequestError(f"{ep.url} refused the request ({status}): {text}. "
                                            f"Check --api-key.") from None
                if status == 404:
                    raise FatalRequestError(f"{ep.url} answered 404 for model {self.model!r}: {text}. "
                                            f"Check --model (and that --endpoint ends in /v1).") from None
                if is_context_error(status, text):
                    raise ContextTooLongError(text) from None
                if status == 400 and "tool-call-parser" in text:  # every request with tools would fail the same
                    raise FatalRequestError(
                        f"{ep.url} cannot take the conversations' tools: {text}. Start the server with "
                        f"--enable-auto-tool-choice --tool-call-parser NAME (kimi_k2 for Kimi, hermes for Qwen3, "
                        f"deepseek_v31 for DeepSeek-V3.1: `eagle3-train generate --help`), so that the model's "
                        f"new calls come back as tool_calls and not as plain text") from None
                if status not in (408, 429) and status < 500:
                    raise RequestRejected(f"{status}: {text}") from None
                error = f"{status}: {text}"
            except (openai.APIConnectionError, _Deadline) as e:  # includes timeouts
                error = f"{type(e).__name__}: {e}"
                dropped = attempt == 0 and not isinstance(e, openai.APITimeoutError | _Deadline)
            finally:
                ep.in_flight -= 1
            ep.failures += 1
            avoid = i if len(self.endpoints) > 1 else None
            if attempt == self.max_retries:
                raise EndpointUnavailable(f"request failed {self.max_retries + 1} times, last on {ep.url}: {error}")
            backoff = min(self.backoff_s * 2 ** attempt, self.backoff_max_s) * (0.5 + random.random() / 2)
            delay = 0.0 if dropped else backoff
            self.retries += 1
            log.warning("%s: %s; retry %d/%d in %.1f s", ep.url, error, attempt + 1, self.max_retries, delay)
            await asyncio.sleep(delay)
        raise AssertionError("unreachable")
