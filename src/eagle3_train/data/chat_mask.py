"""Loss masks derived from the chat template itself: 1 on each assistant reply and its end-of-turn token.

No template strings are hard-coded. For assistant message i the template is rendered three ways:
- `messages[:i]` with the generation prompt: the reply starts where this rendering ends (after the assistant header);
- `messages[:i] + [assistant SENTINEL]`: whatever follows the sentinel is the turn suffix (`<|im_end|>\\n`,
  `<|eot_id|>`, ...); its end-of-turn marker is the suffix up to and including its first special token (or the
  whole suffix without trailing whitespace when it has none); what follows the marker (the newline between turns)
  is not supervised, since generation stops at the marker;
- `messages[:i+1]`: the reply ends where this rendering ends, minus the suffix.
Character spans are mapped to tokens through the fast tokenizer's offsets; a token is supervised when it starts
inside a span. Default system prompts, `| trim`-ing templates and headers are handled because every position comes
from renderings of the same template.

The same probes tell the offline evaluator where a turn ends: `end_of_turn_token_id` (the token generation stops
at, the last supervised token of every reply) and `user_turn_delimiters` (to find user turns in rendered text), so
training and evaluation read one template the same way.

Python API: `ChatMasker(tokenizer, chat_template=None)` with `.spans(messages)`, `.encode(messages)`,
`.encode_batch(list_of_messages)`; `supervised_runs(input_ids, loss_mask)`; `format_masked(tokenizer, ids, mask)`;
`end_of_turn_token_id(tokenizer, chat_template=None)`; `user_turn_delimiters(tokenizer, chat_template=None)`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

_SENTINEL = "eagle3sentinelXq7Z"
# An assistant message carrying this key (true) is context, not supervised (an earlier turn of a conversation split
# at its user turns: see data/reasoning.split_at_user_turns).
UNSUPERVISED = "eagle3_unsupervised"


class ChatTemplateError(ValueError):
    """The chat template cannot render this conversation, or renders it inconsistently across prefixes."""


@dataclass
class MaskedSample:
    text: str
    spans: list[tuple[int, int]]  # supervised character spans of `text`
    input_ids: list[int]
    loss_mask: list[int]

    @property
    def n_supervised(self) -> int:
        return int(sum(self.loss_mask))


class ChatMasker:
    def __init__(self, tokenizer, chat_template: str | None = None, template_kwargs: dict[str, Any] | None = None):
        """`template_kwargs`: the variables every rendering passes the template (the `chat_template_kwargs` the
        conversations were generated with, e.g. Kimi's `thinking: false`)."""
        if not getattr(tokenizer, "is_fast", False):
            raise ValueError(f"{type(tokenizer).__name__} is not a fast tokenizer; loss masks need its offsets "
                             f"mapping (load the tokenizer with a tokenizer.json)")
        self.tokenizer = tokenizer
        self.chat_template = chat_template or tokenizer.chat_template
        if not self.chat_template:
            raise ValueError("the tokenizer has no chat template (no chat_template.jinja, none in "
                             "tokenizer_config.json): give prepare one with --chat-template FILE.jinja (a run "
                             "config: prepare.chat_template), or add chat_template.jinja to the verifier directory")
        self.template_kwargs = dict(template_kwargs or {})
        self._specials = special_tokens(tokenizer)
        self._marker_cache: dict[str, str] = {}

    def render(self, messages: list[dict[str, str]], add_generation_prompt: bool = False,
               tools: list[dict[str, Any]] | None = None) -> str:
        try:
            return self.tokenizer.apply_chat_template(messages, chat_template=self.chat_template, tokenize=False,
                                                      add_generation_prompt=add_generation_prompt, tools=tools,
                                                      **self.template_kwargs)
        except Exception as e:  # noqa: BLE001 - jinja raises TemplateError, templates raise their own messages
            raise ChatTemplateError(f"the chat template failed: {e}") from None

    def renders_reasoning(self) -> bool:
        """Whether the template renders an assistant message's `reasoning_content` (thinking-model templates)."""
        probe = [{"role": "user", "content": "q"},
                 {"role": "assistant", "content": "a", "reasoning_content": _SENTINEL}]
        try:
            return _SENTINEL in self.render(probe)
        except ChatTemplateError:
            return False

    def drops_earlier_reasoning(self) -> bool:
        """Whether the template renders reasoning only after the last user turn (Kimi, Qwen3, DeepSeek-R1 templates):
        the reasoning of earlier turns is then absent from a whole multi-turn rendering."""
        probe = [{"role": "user", "content": "q"},
                 {"role": "assistant", "content": "a", "reasoning_content": _SENTINEL + "1"},
                 {"role": "user", "content": "q2"},
                 {"role": "assistant", "content": "b", "reasoning_content": _SENTINEL + "2"}]
        try:
            text = self.render(probe)
        except ChatTemplateError:
            return False
        return _SENTINEL + "2" in text and _SENTINEL + "1" not in text

    def end_marker(self, suffix: str) -> str:
        """The end-of-turn part of a turn suffix: up to and including its first special token."""
        if suffix not in self._marker_cache:
            self._marker_cache[suffix] = end_marker(suffix, self._specials)
        return self._marker_cache[suffix]

    def spans(self, messages: list[dict[str, str]], max_tokens: int | None = None,
              tools: list[dict[str, Any]] | None = None) -> tuple[str, list[tuple[int, int]]]:
        """Render the conversation (offering `tools`); return the text and the character span of each assistant
        reply + marker.

        `max_tokens`: only the first max_tokens tokens will be kept, so replies that start later are not probed
        (each probe renders the conversation so far: without a bound, masking costs quadratic time in turns)."""
        def render(msgs: list[dict[str, Any]], add_generation_prompt: bool = False) -> str:
            return self.render(msgs, add_generation_prompt, tools)

        full = render(messages)
        out = []
        for i, m in enumerate(messages):
            if m["role"] != "assistant" or m.get(UNSUPERVISED):
                continue
            prompt = render(messages[:i], add_generation_prompt=True)
            if not full.startswith(prompt):
                raise ChatTemplateError(f"message {i}: the rendering of the earlier messages plus the generation "
                                        f"prompt is not a prefix of the whole conversation")
            if max_tokens is not None and len(prompt) > max_tokens and self._token_count(prompt) > max_tokens:
                break  # this reply and the later ones start past the cut (a token more: a merge at the boundary)
            start = len(prompt)
            probe = render(messages[:i] + [{"role": "assistant", "content": _SENTINEL}])
            k = probe.rfind(_SENTINEL)
            if k < 0:
                raise ChatTemplateError(f"message {i}: the template drops the assistant content")
            suffix = probe[k + len(_SENTINEL):]
            marker = self.end_marker(suffix)
            upto = render(messages[:i + 1])
            if full.startswith(upto) and upto.endswith(suffix) and len(upto) - len(suffix) >= start:
                end = len(upto) - len(suffix)
            elif marker:
                # The template renders a turn differently when it is the last one (e.g. reasoning blocks kept
                # only in the final reply): find this turn's end-of-turn marker in the whole rendering instead.
                end = full.find(marker, start)
                if end < 0:
                    raise ChatTemplateError(f"message {i}: end-of-turn marker {marker!r} not found")
            else:
                raise ChatTemplateError(f"message {i}: the template renders this turn differently when it is last "
                                        f"and has no end-of-turn marker to find it by")
            out.append((start, end + len(marker)))
        return full, out

    def _token_count(self, text: str) -> int:
        return len(self.tokenizer(text, add_special_tokens=False, return_attention_mask=False,
                                  verbose=False)["input_ids"])

    def encode_batch(self, conversations: list[list[dict[str, str]]], max_tokens: int | None = None,
                     tools: list[list[dict[str, Any]] | None] | None = None) -> list[MaskedSample | ChatTemplateError]:
        """Encode many conversations with one tokenizer call; a failed one yields its ChatTemplateError.
        `max_tokens`: the masks are exact on the first max_tokens tokens (see `spans`); `tools`: each
        conversation's functions (None: none)."""
        results: list[MaskedSample | ChatTemplateError] = []
        rendered: list[tuple[int, str, list[tuple[int, int]]]] = []
        for j, messages in enumerate(conversations):
            try:
                text, spans = self.spans(messages, max_tokens, tools[j] if tools else None)
            except ChatTemplateError as e:
                results.append(e)
                continue
            rendered.append((len(results), text, spans))
            results.append(None)  # type: ignore[arg-type]  # filled below
        if rendered:
            # The template already holds the special tokens (BOS etc.), as when a server renders a chat request.
            enc = self.tokenizer([t for _, t, _ in rendered], add_special_tokens=False, return_offsets_mapping=True,
                                 return_attention_mask=False, verbose=False)
            for (slot, text, spans), ids, offsets in zip(rendered, enc["input_ids"], enc["offset_mapping"]):
                starts = np.asarray(offsets, dtype=np.int64).reshape(-1, 2)[:, 0]
                mask = _in_spans(starts, spans)
                results[slot] = MaskedSample(text=text, spans=spans, input_ids=list(ids),
                                             loss_mask=mask.astype(np.int64).tolist())
        return results

    def encode(self, messages: list[dict[str, str]]) -> MaskedSample:
        result = self.encode_batch([messages])[0]
        if isinstance(result, ChatTemplateError):
            raise result
        return result


def _in_spans(starts: np.ndarray, spans: list[tuple[int, int]]) -> np.ndarray:
    """Whether each token start lies in one of the ordered, disjoint `spans` (a binary search per token: a loop over
    spans costs tokens x turns, minutes for a conversation of thousands of turns)."""
    if not spans:
        return np.zeros(len(starts), dtype=bool)
    a, b = (np.asarray(x, dtype=np.int64) for x in zip(*spans))
    k = np.searchsorted(a, starts, side="right") - 1
    return (k >= 0) & (starts < b[np.maximum(k, 0)])


def special_tokens(tokenizer) -> list[str]:
    """The tokenizer's special tokens, longest first (a token containing another one is matched first)."""
    specials = {t.content for t in tokenizer.added_tokens_decoder.values() if t.special}
    specials |= set(tokenizer.all_special_tokens)
    return sorted((s for s in specials if s), key=len, reverse=True)


def end_marker(suffix: str, specials: Sequence[str]) -> str:
    """The end-of-turn part of a turn suffix: up to and including its first special token (the longest one starting
    there), else the whole suffix without trailing whitespace."""
    best = None
    for s in specials:  # longest first: on a tie of positions the longest wins
        k = suffix.find(s)
        if k >= 0 and (best is None or k < best[0]):
            best = (k, s)
    return suffix[:best[0] + len(best[1])] if best else suffix.rstrip()


def assistant_end_marker(tokenizer, chat_template: str | None = None) -> str:
    """The end-of-turn marker the template writes after an assistant reply ("" when it drops the reply)."""
    probe = tokenizer.apply_chat_template([{"role": "user", "content": "hi"},
                                           {"role": "assistant", "content": _SENTINEL}],
                                          chat_template=chat_template, tokenize=False)
    k = probe.rfind(_SENTINEL)
    return end_marker(probe[k + len(_SENTINEL):], special_tokens(tokenizer)) if k >= 0 else ""


def end_of_turn_token_id(tokenizer, chat_template: str | None = None) -> int | None:
    """The token id of the assistant end-of-turn marker when it is one token (where generation stops), else None."""
    marker = assistant_end_marker(tokenizer, chat_template)
    ids = tokenizer(marker, add_special_tokens=False)["input_ids"] if marker else []
    return ids[0] if len(ids) == 1 else None


def user_turn_delimiters(tokenizer, chat_template: str | None = None) -> tuple[str, str]:
    """(header, end marker) around a user message's content, read from the chat template itself."""
    probe = tokenizer.apply_chat_template([{"role": "user", "content": _SENTINEL}], chat_template=chat_template,
                                          tokenize=False)
    k = probe.find(_SENTINEL)
    prefix, suffix = probe[:k], probe[k + len(_SENTINEL):]
    specials = special_tokens(tokenizer)
    starts = sorted({i for s in specials for i in find_all(prefix, s)})
    header = prefix
    if starts:
        header = prefix[starts[-1]:]
        # "<|end_header_id|>\n\n" alone would match every role: reach back to the token naming the role.
        if "user" not in header and len(starts) > 1:
            header = prefix[starts[-2]:]
    return header, end_marker(suffix, specials)


def find_all(text: str, sub: str) -> list[int]:
    """Start offsets of every (possibly overlapping) occurrence of `sub` in `text`."""
    out, i = [], text.find(sub)
    while i >= 0:
        out.append(i)
        i = text.find(sub, i + 1)
    return out


def supervised_runs(input_ids, loss_mask) -> list[list[int]]:
    """Token ids of each contiguous supervised run (one per assistant reply unless truncated)."""
    runs: list[list[int]] = []
    prev = 0
    for tok, m in zip(input_ids, loss_mask):
        if m and not prev:
            runs.append([])
        if m:
            runs[-1].append(int(tok))
        prev = m
    return runs


def format_masked(tokenizer, input_ids, loss_mask, color: bool = False) -> str:
    """Decode a sample with supervised runs highlighted: green (ANSI) or wrapped in «...»."""
    parts = []
    k = 0
    n = len(input_ids)
    while k < n:
        j = k
        while j < n and bool(loss_mask[j]) == bool(loss_mask[k]):
            j += 1
        text = tokenizer.decode([int(t) for t in input_ids[k:j]], skip_special_tokens=False)
        if loss_mask[k]:
            text = f"\x1b[32m{text}\x1b[0m" if color else f"«{text}»"
        parts.append(text)
        k = j
    return "".join(parts)
