"""A simulated Kimi-K2 tokenizer, built by the tests: Kimi's file layout and remote-code mechanics with ranks taken
from a BPE that ships here (SmolLM2's merges, in merge order).

What it shares with Kimi-K2/K2.5's tokenizer: no `tokenizer.json`; `tiktoken.model` (one `base64(token) rank` line per
mergeable token); `tokenization_kimi.py` defining `TikTokenTokenizer`, a `PreTrainedTokenizer` (slow) subclass over
`tiktoken.Encoding`, loaded through `auto_map` with `trust_remote_code`; special tokens in a reserved block after the
ranks, listed in `added_tokens_decoder`; Kimi's chat markup (`<|im_user|>user<|im_middle|>...<|im_end|>`), thinking
in `<think>...</think>` kept only after the last user turn (earlier turns' thinking is dropped, as Kimi's template
does), and tool calls in `<|tool_calls_section_begin|>...` sections. The pre-tokenizer pattern splits Han runs first
as Kimi's does. Everything here is written for the tests; no Kimi file is copied.
"""

from __future__ import annotations

import base64
import json
from pathlib import Path

SPECIALS = ("[BOS]", "[EOS]", "<|im_end|>", "<|im_user|>", "<|im_assistant|>", "<|im_system|>", "<|im_middle|>",
            "[EOT]", "<think>", "</think>", "<|tool_calls_section_begin|>", "<|tool_calls_section_end|>",
            "<|tool_call_begin|>", "<|tool_call_argument_begin|>", "<|tool_call_end|>")
RESERVED = 256  # special-token block after the ranks, as Kimi reserves one

PATTERN = "|".join([
    r"[\p{Han}]+",
    r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
    r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
    r"\p{N}{1,3}",
    r" ?[^\s\p{L}\p{N}]+[\r\n]*",
    r"\s*[\r\n]+",
    r"\s+(?!\S)",
    r"\s+",
])

TOKENIZER_CODE = '''"""Simulated Kimi tokenizer (eagle3-train tests): tiktoken ranks behind a slow tokenizer."""
from pathlib import Path

import tiktoken
from tiktoken.load import load_tiktoken_bpe
from transformers.convert_slow_tokenizer import bytes_to_unicode
from transformers.tokenization_utils import PreTrainedTokenizer


class TikTokenTokenizer(PreTrainedTokenizer):
    vocab_files_names = {"vocab_file": "tiktoken.model"}
    model_input_names = ["input_ids", "attention_mask"]
    pat_str = %(pattern)r

    def __init__(self, vocab_file, bos_token="[BOS]", eos_token="[EOS]", unk_token=None, pad_token=None,
                 added_tokens_decoder=None, **kwargs):
        ranks = load_tiktoken_bpe(vocab_file)
        specials = {str(t.content if hasattr(t, "content") else t["content"]): int(i)
                    for i, t in (added_tokens_decoder or {}).items()}
        self.vocab_file = vocab_file
        self.model = tiktoken.Encoding(name=Path(vocab_file).parent.name, pat_str=self.pat_str,
                                       mergeable_ranks=ranks, special_tokens=specials)
        self.byte_encoder = bytes_to_unicode()
        self.byte_decoder = {v: k for k, v in self.byte_encoder.items()}
        self.decoder = {i: "".join(self.byte_encoder[b] for b in tok) for tok, i in ranks.items()}
        self.decoder.update({i: s for s, i in specials.items()})
        self.encoder = {s: i for i, s in self.decoder.items()}
        super().__init__(bos_token=bos_token, eos_token=eos_token, unk_token=unk_token, pad_token=pad_token,
                         added_tokens_decoder=added_tokens_decoder, **kwargs)

    @property
    def vocab_size(self):
        return self.model.n_vocab

    def get_vocab(self):
        return dict(self.encoder)

    def _tokenize(self, text, **kwargs):
        return [self.decoder[i] for i in self.model.encode(text, allowed_special=set(), disallowed_special=())]

    def _convert_token_to_id(self, token):
        return self.encoder[token]

    def _convert_id_to_token(self, index):
        return self.decoder[index]

    def convert_tokens_to_string(self, tokens):
        return bytearray(self.byte_decoder[c] for c in "".join(tokens)).decode("utf-8", errors="replace")

    def save_vocabulary(self, save_directory, filename_prefix=None):
        return (self.vocab_file,)
'''

CHAT_TEMPLATE = """
{%- set ns = namespace(last_user=-1) -%}
{%- for m in messages -%}{%- if m.role == 'user' -%}{%- set ns.last_user = loop.index0 -%}{%- endif -%}{%- endfor -%}
{%- if tools -%}<|im_system|>tool_declare<|im_middle|>{{ tools | tojson }}<|im_end|>{%- endif -%}
{%- for m in messages -%}
{%- if m.role == 'system' -%}<|im_system|>system<|im_middle|>{{ m.content }}<|im_end|>
{%- elif m.role == 'user' -%}<|im_user|>user<|im_middle|>{{ m.content }}<|im_end|>
{%- elif m.role == 'tool' -%}<|im_system|>tool<|im_middle|>## Return of {{ m.tool_call_id }}
{{ m.content }}<|im_end|>
{%- elif m.role == 'assistant' -%}<|im_assistant|>assistant<|im_middle|>
{%- if loop.index0 > ns.last_user and m.reasoning_content -%}<think>{{ m.reasoning_content }}</think>
{%- else -%}<think></think>{%- endif -%}
{{ m.content }}
{%- if m.tool_calls -%}<|tool_calls_section_begin|>
{%- for tc in m.tool_calls -%}<|tool_call_begin|>{{ tc.id }}<|tool_call_argument_begin|>
{%- if tc.function.arguments is string -%}{{ tc.function.arguments }}{%- else -%}{{ tc.function.arguments | tojson }}
{%- endif -%}<|tool_call_end|>{%- endfor -%}<|tool_calls_section_end|>
{%- endif -%}<|im_end|>
{%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}<|im_assistant|>assistant<|im_middle|>
{%- if thinking is defined and thinking is false -%}<think></think>{%- endif -%}
{%- endif -%}
""".strip()


def tiktoken_ranks(tokenizer_json: Path, limit: int) -> dict[bytes, int]:
    """Mergeable ranks from a byte-level BPE's merges: the 256 bytes, then each merge's result in merge order."""
    data = json.loads(tokenizer_json.read_text())
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    decode = {v: k for k, v in bytes_to_unicode().items()}
    ranks = {bytes([b]): b for b in range(256)}
    for merge in data["model"]["merges"]:
        a, b = merge.split(" ") if isinstance(merge, str) else merge
        token = bytes(decode[c] for c in a + b)
        if token not in ranks:
            ranks[token] = len(ranks)
        if len(ranks) >= limit:
            break
    return ranks


def build_kimi_tokenizer(out: Path, bpe_tokenizer_json: Path, vocab_size: int) -> Path:
    """Write the simulated Kimi tokenizer into `out` (a verifier directory): ranks + reserved specials fill
    `vocab_size` ids."""
    out.mkdir(parents=True, exist_ok=True)
    ranks = tiktoken_ranks(bpe_tokenizer_json, vocab_size - RESERVED)
    (out / "tiktoken.model").write_text("".join(f"{base64.b64encode(t).decode()} {r}\n" for t, r in ranks.items()))
    (out / "tokenization_kimi.py").write_text(TOKENIZER_CODE % {"pattern": PATTERN})
    first = len(ranks)
    added = {str(first + i): {"content": s, "lstrip": False, "normalized": False, "rstrip": False,
                              "single_word": False, "special": True} for i, s in enumerate(SPECIALS)}
    config = {"added_tokens_decoder": added, "bos_token": "[BOS]", "eos_token": "[EOS]", "pad_token": "[EOS]",
              "tokenizer_class": "TikTokenTokenizer", "model_max_length": 1048576,
              "auto_map": {"AutoTokenizer": ["tokenization_kimi.TikTokenTokenizer", None]},
              "chat_template": CHAT_TEMPLATE}
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
    for name in ("tokenizer.json", "special_tokens_map.json", "chat_template.jinja"):
        (out / name).unlink(missing_ok=True)
    return out
