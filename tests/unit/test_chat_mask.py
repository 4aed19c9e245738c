"""Template-derived loss masks, golden-style: the supervised tokens of each assistant turn must decode to exactly its
content plus the end-of-turn marker, for several chat-template families written here and set on the SmolLM2
tokenizer."""

from __future__ import annotations

import copy

import pytest

from eagle3_train.data.chat_mask import ChatMasker, ChatTemplateError, format_masked, supervised_runs

# Llama-3 style: header tokens, trimmed content, <|eot_id|> and no newline between turns.
LLAMA3 = r"""{{- '<|begin_of_text|>' -}}
{%- for m in messages -%}
{{- '<|start_header_id|>' + m['role'] + '<|end_header_id|>\n\n' + m['content'] | trim + '<|eot_id|>' -}}
{%- endfor -%}
{%- if add_generation_prompt -%}{{- '<|start_header_id|>assistant<|end_header_id|>\n\n' -}}{%- endif -%}"""

# Qwen-2.5 style: ChatML with its own default system prompt when none is given.
QWEN25 = r"""{%- if messages[0]['role'] != 'system' -%}
{{- '<|im_start|>system\nYou are a test assistant made for unit tests.<|im_end|>\n' -}}
{%- endif -%}
{%- for m in messages -%}{{- '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n' -}}{%- endfor -%}
{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\n' -}}{%- endif -%}"""

# Qwen-3 style: an empty reasoning block only in the final assistant turn, reasoning stripped from earlier turns,
# so a turn renders differently when it is the last one.
QWEN3 = r"""{%- for m in messages -%}
{%- if m['role'] == 'assistant' -%}
{{- '<|im_start|>assistant\n' -}}
{%- if loop.last -%}{{- '<think>\n\n</think>\n\n' -}}{%- endif -%}
{{- m['content'].split('</think>')[-1].lstrip('\n') + '<|im_end|>\n' -}}
{%- else -%}
{{- '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n' -}}
{%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\n' -}}{%- endif -%}"""

# Gemma style: no system role (merged into the first user turn), role 'model', trimmed content.
GEMMA = r"""{%- if messages[0]['role'] == 'system' -%}
{%- set first = messages[0]['content'] | trim + '\n\n' -%}{%- set rest = messages[1:] -%}
{%- else -%}{%- set first = '' -%}{%- set rest = messages -%}{%- endif -%}
{%- for m in rest -%}
{%- set role = 'model' if m['role'] == 'assistant' else m['role'] -%}
{{- '<start_of_turn>' + role + '\n' + (first if loop.first else '') + m['content'] | trim + '<end_of_turn>\n' -}}
{%- endfor -%}
{%- if add_generation_prompt -%}{{- '<start_of_turn>model\n' -}}{%- endif -%}"""

# Vicuna style: plain-text roles and an end marker that is not a special token of this tokenizer.
VICUNA = r"""{%- for m in messages -%}
{%- if m['role'] == 'system' -%}{{- m['content'] + '\n\n' -}}
{%- elif m['role'] == 'user' -%}{{- 'USER: ' + m['content'] + '\n' -}}
{%- else -%}{{- 'ASSISTANT: ' + m['content'] + '</s>\n' -}}{%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}{{- 'ASSISTANT:' -}}{%- endif -%}"""

# name -> (template or None for the tokenizer's own, special tokens to add, end-of-turn marker, strips content)
FAMILIES = {
    "chatml-smollm2": (None, [], "<|im_end|>", False),
    "llama3": (LLAMA3, ["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"],
               "<|eot_id|>", True),
    "qwen2.5": (QWEN25, [], "<|im_end|>", False),
    "qwen3": (QWEN3, [], "<|im_end|>", False),
    "gemma": (GEMMA, ["<start_of_turn>", "<end_of_turn>"], "<end_of_turn>", True),
}

CONVERSATIONS = {
    "single": [{"role": "user", "content": "What is 2+2?"}, {"role": "assistant", "content": "2+2 equals 4."}],
    "system_multi_turn": [
        {"role": "system", "content": "You answer in one line."},
        {"role": "user", "content": "Name a colour."},
        {"role": "assistant", "content": "Blue."},
        {"role": "user", "content": "Another one,\nplease."},
        {"role": "assistant", "content": "Green, like grass.\n\nAnd here is code:\n```py\nprint('hi')\n```"},
        {"role": "user", "content": "Thanks!"},
        {"role": "assistant", "content": "You're welcome — à bientôt ✓"},
    ],
    "whitespace": [{"role": "user", "content": "  spaced question  "},
                   {"role": "assistant", "content": " padded answer \n"},
                   {"role": "user", "content": "ok"},
                   {"role": "assistant", "content": "fine"}],
}


@pytest.fixture(scope="module")
def maskers(smollm2_tokenizer):
    out = {}
    for name, (template, specials, _, _) in FAMILIES.items():
        tok = copy.deepcopy(smollm2_tokenizer)
        if specials:
            tok.add_special_tokens({"additional_special_tokens": specials})
        out[name] = ChatMasker(tok, template)
    return out


def expected_runs(name: str, messages: list[dict]) -> list[str]:
    _, _, eot, strips = FAMILIES[name]
    assistant = [m["content"] for m in messages if m["role"] == "assistant"]
    texts = [c.strip() if strips else c for c in assistant]
    if name == "qwen3":  # the final reply carries the (empty) reasoning block the model generates first
        texts[-1] = "<think>\n\n</think>\n\n" + texts[-1]
    return [t + eot for t in texts]


@pytest.mark.parametrize("conv", sorted(CONVERSATIONS))
@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_supervised_tokens_are_exactly_the_replies(maskers, name, conv):
    masker = maskers[name]
    messages = CONVERSATIONS[conv]
    sample = masker.encode(messages)
    tok = masker.tokenizer
    runs = [tok.decode(r, skip_special_tokens=False) for r in supervised_runs(sample.input_ids, sample.loss_mask)]
    assert runs == expected_runs(name, messages)
    # the token ids are those the template gives when a server tokenizes the same chat
    reference = tok.apply_chat_template(messages, chat_template=masker.chat_template, tokenize=True)
    reference = reference["input_ids"] if hasattr(reference, "keys") else reference
    assert sample.input_ids == list(reference)
    assert len(sample.loss_mask) == len(sample.input_ids) and set(sample.loss_mask) <= {0, 1}


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_nothing_after_the_end_of_turn_and_no_prompt_text(maskers, name):
    masker = maskers[name]
    messages = CONVERSATIONS["system_multi_turn"]
    sample = masker.encode(messages)
    supervised = "".join(masker.tokenizer.decode([t], skip_special_tokens=False)
                         for t, m in zip(sample.input_ids, sample.loss_mask) if m)
    for m in messages:
        if m["role"] != "assistant":
            assert m["content"].strip() not in supervised
    eot = FAMILIES[name][2]
    # every supervised run ends on the marker; the next token (the separator or next header) is not supervised
    for a, b in sample.spans:
        assert sample.text[a:b].endswith(eot)
    last = max(k for k, m in enumerate(sample.loss_mask) if m)
    assert masker.tokenizer.decode([sample.input_ids[last]], skip_special_tokens=False) == eot
    assert all(m == 0 for m in sample.loss_mask[last + 1:])


def test_default_system_prompt_is_not_supervised(maskers):
    sample = maskers["chatml-smollm2"].encode(CONVERSATIONS["single"])
    assert "You are a helpful AI assistant named SmolLM" in sample.text
    first = sample.loss_mask.index(1)
    assert "SmolLM" in maskers["chatml-smollm2"].tokenizer.decode(sample.input_ids[:first])


def test_plain_text_end_marker(smollm2_tokenizer):
    masker = ChatMasker(smollm2_tokenizer, VICUNA)
    messages = CONVERSATIONS["system_multi_turn"]
    sample = masker.encode(messages)
    # without a special token in the turn suffix, the marker is the suffix minus trailing whitespace ("</s>");
    # the generation prompt "ASSISTANT:" has no space, so the reply starts with the space the model generates
    got = [sample.text[a:b] for a, b in sample.spans]
    assert got == [" " + m["content"] + "</s>" for m in messages if m["role"] == "assistant"]
    runs = [smollm2_tokenizer.decode(r) for r in supervised_runs(sample.input_ids, sample.loss_mask)]
    assert runs == got


def test_template_errors_are_per_conversation(smollm2_tokenizer):
    no_system = ("{%- if messages[0]['role'] == 'system' -%}{{ raise_exception('no system role') }}{%- endif -%}"
                 + QWEN25)
    masker = ChatMasker(smollm2_tokenizer, no_system)
    results = masker.encode_batch([CONVERSATIONS["system_multi_turn"], CONVERSATIONS["single"]])
    assert isinstance(results[0], ChatTemplateError) and "no system role" in str(results[0])
    assert results[1].n_supervised > 0
    with pytest.raises(ChatTemplateError):
        masker.encode(CONVERSATIONS["system_multi_turn"])


def test_template_that_drops_replies_is_rejected(smollm2_tokenizer):
    users_only = "{%- for m in messages -%}{%- if m['role'] == 'user' -%}{{ m['content'] }}{%- endif -%}{%- endfor -%}"
    with pytest.raises(ChatTemplateError):
        ChatMasker(smollm2_tokenizer, users_only).encode(CONVERSATIONS["single"])


def test_tokenizer_without_template(smollm2_tokenizer):
    tok = copy.deepcopy(smollm2_tokenizer)
    tok.chat_template = None
    with pytest.raises(ValueError, match="no chat template"):
        ChatMasker(tok)


def test_format_masked(maskers):
    masker = maskers["chatml-smollm2"]
    sample = masker.encode(CONVERSATIONS["single"])
    plain = format_masked(masker.tokenizer, sample.input_ids, sample.loss_mask)
    assert "«2+2 equals 4.<|im_end|>»" in plain and plain.count("«") == 1
    colored = format_masked(masker.tokenizer, sample.input_ids, sample.loss_mask, color=True)
    assert "\x1b[32m2+2 equals 4.<|im_end|>\x1b[0m" in colored


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_evaluation_stops_where_training_supervision_ends(maskers, name):
    """The offline evaluator stops generating at `end_of_turn_token_id` and finds user turns by
    `user_turn_delimiters`; both must read the template as the loss mask does: the stop token is the last supervised
    token of every reply, and the user turns of a rendered training sample are found again."""
    from eagle3_train.data.chat_mask import end_of_turn_token_id, user_turn_delimiters
    from eagle3_train.evaluate.held_out import normalize_text, user_turns_of

    masker = maskers[name]
    # no system message: templates without a system role (gemma) merge it into the first user turn
    messages = [m for m in CONVERSATIONS["system_multi_turn"] if m["role"] != "system"]
    sample = masker.encode(messages)
    eot = end_of_turn_token_id(masker.tokenizer, masker.chat_template)
    assert eot is not None and masker.tokenizer.decode([eot], skip_special_tokens=False) == FAMILIES[name][2]
    ends = [k for k, m in enumerate(sample.loss_mask) if m and (k + 1 == len(sample.loss_mask)
                                                                or not sample.loss_mask[k + 1])]
    assert len(ends) == sum(m["role"] == "assistant" for m in messages)
    assert all(sample.input_ids[k] == eot for k in ends)
    header, end = user_turn_delimiters(masker.tokenizer, masker.chat_template)
    text = masker.tokenizer.decode(sample.input_ids, skip_special_tokens=False)
    users = [normalize_text(m["content"]) for m in messages if m["role"] == "user"]
    assert user_turns_of(text, header, end) == users


@pytest.mark.parametrize("name", list(FAMILIES))
def test_a_bound_on_tokens_masks_the_kept_tokens_exactly(maskers, name):
    """prepare keeps the first max_length tokens: the masker stops probing replies that start past them (its cost no
    longer grows with the square of the turns) and the kept tokens' mask is the unbounded one."""
    turns = [m for i in range(300) for m in ({"role": "user", "content": f"question {i} " * (i % 5 + 1)},
                                              {"role": "assistant", "content": f"answer {i}." * (i % 3 + 1)})]
    full = maskers[name].encode(turns)
    for bound in (8, 200, 777):  # 8: before the first reply
        cut = maskers[name].encode_batch([turns], max_tokens=bound)[0]
        assert cut.input_ids == full.input_ids
        assert cut.loss_mask[:bound] == full.loss_mask[:bound] and (sum(cut.loss_mask[:bound]) > 0) == (bound > 8)
        assert sum(cut.loss_mask) < sum(full.loss_mask)  # later replies were not probed
