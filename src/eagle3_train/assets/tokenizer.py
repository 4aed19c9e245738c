"""The verifier's tokenizer as a fast (Rust) tokenizer, whatever it ships as.

Loss masks need character offsets, which only fast tokenizers give. Kimi-K2/K2.5 ship a remote-code tiktoken
tokenizer instead (`tokenization_kimi.py` + `tiktoken.model`, no `tokenizer.json`): a slow `PreTrainedTokenizer` over
`tiktoken.Encoding`. `load_tokenizer` loads the verifier's own class (remote code only with `trust_remote_code`), and
when it is such a tiktoken tokenizer converts it once in memory with transformers' `TikTokenConverter` (its ranks,
its pre-tokenizer pattern, its special tokens at their ids, its chat template), then checks the conversion token for
token against the original on probe texts and on the caller's texts: a difference is an error, never silent.

Python API: `load_tokenizer(path, trust_remote_code, check_texts=()) -> PreTrainedTokenizerFast`,
`converted_from(tokenizer)`, `check_same_tokens(slow, fast, texts, path)`,
`tokenizer_digest(path) -> (file name, sha256)`, `choose_mask_token(tokenizer, vocab_size)`.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from eagle3_train.assets.verifier import from_pretrained
from eagle3_train.utils.io import Eagle3InputError, sha256_file

log = logging.getLogger(__name__)

# What a conversion must reproduce: words, case, contractions, digits, CJK, code, whitespace runs, byte fallback.
PROBES = ("Hello world, HELLO World! It's we've they'll I'M 1234567 3.14",
          "你好世界，這是測試。日本語のテキスト 한국어",
          "def f(x):\n\treturn x ** 2  # comment\n\n\n    indented\r\n",
          "emoji 🤖🚀 and accents: café naïve Ωmega — “quotes”",
          "   leading and trailing spaces   ")
_VOCAB_FILES = ("tokenizer.json", "tiktoken.model", "tokenizer.model", "vocab.json")


def load_tokenizer(path: str | Path, trust_remote_code: bool = False, check_texts: Iterable[str] = ()) -> Any:
    """The tokenizer of the checkpoint at `path` as a fast tokenizer (converted from tiktoken when it ships so)."""
    from transformers import AutoTokenizer

    declared = _remote_tokenizer_class(path)
    if declared and not trust_remote_code:
        # transformers 5 would quietly build a fast tokenizer from tiktoken.model with ITS default pre-tokenizer
        # pattern, not the model's (Kimi splits Han runs apart): not the verifier's tokenizer
        raise Eagle3InputError(f"{path} ships its own tokenizer code ({declared}, named by auto_map in "
                               f"tokenizer_config.json): loading it runs that code. Pass --trust-remote-code "
                               f"(YAML: trust_remote_code: true) if you trust it")
    tokenizer = from_pretrained(AutoTokenizer, path, trust_remote_code)
    if getattr(tokenizer, "is_fast", False):
        return tokenizer
    encoding = _tiktoken_encoding(tokenizer)
    if encoding is None:
        raise Eagle3InputError(f"{path}: {type(tokenizer).__name__} is a slow tokenizer that is not tiktoken-based; "
                               f"loss masks need a fast tokenizer's character offsets (add its tokenizer.json)")
    fast = _convert(tokenizer, encoding, path)
    check_same_tokens(tokenizer, fast, [*PROBES, *check_texts], path)
    fast.eagle3_converted_from = tokenizer  # prepare checks every conversation against it
    log.info("%s: converted %s (tiktoken, %d ranks) to a fast tokenizer; identical on the probe texts", path,
             type(tokenizer).__name__, len(encoding._mergeable_ranks))
    return fast


def _remote_tokenizer_class(path: str | Path) -> str | None:
    """The tokenizer class a local checkpoint's tokenizer_config.json maps to its own code (auto_map), if any."""
    config = Path(path) / "tokenizer_config.json"
    try:
        auto_map = json.loads(config.read_text()).get("auto_map") or {}
    except (OSError, ValueError):
        return None
    entry = auto_map.get("AutoTokenizer") if isinstance(auto_map, dict) else None
    names = [e for e in (entry if isinstance(entry, list) else [entry]) if e]
    return names[0] if names else None


def _tiktoken_encoding(tokenizer: Any) -> Any:
    try:
        import tiktoken
    except ImportError:
        return None
    for attr in ("model", "tokenizer", "encoding", "_tokenizer"):
        value = getattr(tokenizer, attr, None)
        if isinstance(value, tiktoken.Encoding):
            return value
    return None


def _convert(slow: Any, encoding: Any, path: str | Path) -> Any:
    from tokenizers import AddedToken
    from transformers import PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import TikTokenConverter

    class FromRanks(TikTokenConverter):
        def load_tiktoken_bpe(self, _url: str) -> dict[bytes, int]:
            return encoding._mergeable_ranks

    backend = FromRanks(vocab_file=str(path), pattern=encoding._pat_str).converted()
    specials = {int(i): t for i, t in slow.added_tokens_decoder.items()}
    specials.update({i: AddedToken(s, special=True) for s, i in encoding._special_tokens.items() if i not in specials})
    next_id = backend.get_vocab_size(with_added_tokens=True)
    for i in sorted(specials):
        if i < next_id:
            continue  # already a rank (never for Kimi's reserved block)
        if i != next_id:
            raise Eagle3InputError(f"{path}: special token ids are not contiguous after the ranks (expected {next_id}, "
                                   f"got {i} for {specials[i].content!r}); cannot convert to a fast tokenizer")
        t = specials[i]
        backend.add_special_tokens([AddedToken(t.content, special=True, normalized=False, lstrip=t.lstrip,
                                               rstrip=t.rstrip, single_word=t.single_word)])
        next_id += 1
    fast = PreTrainedTokenizerFast(tokenizer_object=backend, bos_token=slow.bos_token, eos_token=slow.eos_token,
                                   unk_token=slow.unk_token, pad_token=slow.pad_token,
                                   model_max_length=slow.model_max_length, clean_up_tokenization_spaces=False)
    fast.chat_template = slow.chat_template
    return fast


def converted_from(tokenizer: Any) -> Any:
    """The verifier's own (slow) tokenizer a fast one was converted from by `load_tokenizer`, else None."""
    return getattr(tokenizer, "eagle3_converted_from", None)


def check_same_tokens(slow: Any, fast: Any, texts: Iterable[str], path: str | Path) -> None:
    for text in texts:
        a = slow.encode(text, add_special_tokens=False)
        b = fast.encode(text, add_special_tokens=False)
        if a != b:
            at = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
            raise Eagle3InputError(f"{path}: the fast tokenizer converted from {type(slow).__name__} differs from it "
                                   f"at token {at} of {text[:60]!r}... (original {a[at:at + 5]}, converted "
                                   f"{b[at:at + 5]}); prepared data would not be what the verifier reads")


def tokenizer_digest(path: str | Path) -> tuple[str, str] | None:
    """(file, sha256) of the file that defines the tokenizer's vocabulary (tokenizer.json, or tiktoken.model...)."""
    for name in _VOCAB_FILES:
        f = Path(path) / name
        if f.is_file():
            return name, sha256_file(f)
    return None


def choose_mask_token(tokenizer: Any, vocab_size: int) -> int:
    """The token a parallel-drafting draft writes into its mask slots, as the reference trainers pick it: the
    tokenizer's mask token, else the first embedding row past the tokenizer's tokens (one no text produces), else its
    pad token, else eos (its embedding is the verifier's, frozen; a mask slot is told apart by its learned hidden
    state, not by the token)."""
    for candidate in (getattr(tokenizer, "mask_token_id", None),
                      len(tokenizer) if len(tokenizer) < vocab_size else None,
                      getattr(tokenizer, "pad_token_id", None), getattr(tokenizer, "eos_token_id", None)):
        if isinstance(candidate, int) and 0 <= candidate < vocab_size:
            return candidate
    raise Eagle3InputError("the verifier's tokenizer has no mask, pad or eos token and no spare embedding row: "
                           "set train.mask_token_id")
