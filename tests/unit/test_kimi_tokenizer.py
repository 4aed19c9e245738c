"""A Kimi-style verifier tokenizer (remote-code tiktoken, no tokenizer.json; testing/kimi_tokenizer.py) through prepare:
loaded only with --trust-remote-code, converted to a fast tokenizer that gives the same tokens as the verifier's own on
every prepared conversation, and a multi-turn conversation with thinking and tool calls masked exactly on the
assistant spans of the template's own rendering — every turn's reasoning supervised once although the template drops
earlier turns' thinking."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest

from eagle3_train.assets.conversations import load_conversations, sharegpt_path
from eagle3_train.assets.tokenizer import check_same_tokens, load_tokenizer
from eagle3_train.data.prepare import check_prepared_tokenizer, load_prepared, prepare
from eagle3_train.testing.kimi_tokenizer import build_kimi_tokenizer
from eagle3_train.testing.tiny_verifiers import _config
from eagle3_train.utils.io import Eagle3InputError

CALL = {"id": "functions.get_weather:0", "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
CONVERSATION = {"id": "k1", "messages": [
    {"role": "system", "content": "You are Kimi."},
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": "", "reasoning_content": "I should call the weather tool.", "tool_calls": [CALL]},
    {"role": "tool", "tool_call_id": CALL["id"], "content": "18C, sunny"},
    {"role": "assistant", "content": "It is 18C and sunny in Paris.", "reasoning_content": "Report the result."},
    {"role": "user", "content": "And tomorrow?"},
    {"role": "assistant", "content": "Probably similar.", "reasoning_content": "No forecast tool; estimate."}]}
HEADER, END = "<|im_assistant|>assistant<|im_middle|>", "<|im_end|>"


@pytest.fixture(scope="module")
def kimi_dir(tmp_path_factory, smollm2_dir) -> Path:
    """A verifier directory with a tiny DeepSeek-V3 config (Kimi-K2's architecture) and the simulated Kimi tokenizer."""
    out = tmp_path_factory.mktemp("kimi")
    _config("deepseek_v3").save_pretrained(out)
    return build_kimi_tokenizer(out, smollm2_dir / "tokenizer.json", vocab_size=49152)


def test_its_code_runs_only_with_trust_remote_code(kimi_dir, tmp_path):
    data = tmp_path / "c.jsonl"
    data.write_text(json.dumps(CONVERSATION) + "\n")
    with pytest.raises(Eagle3InputError, match="trust-remote-code"):
        prepare(data, kimi_dir, tmp_path / "prep", val_count=0)
    assert not (tmp_path / "prep" / "manifest.json").exists()


def test_the_fast_conversion_gives_the_verifiers_own_tokens(kimi_dir, smollm2_dir):
    from transformers import AutoTokenizer

    slow = AutoTokenizer.from_pretrained(kimi_dir, trust_remote_code=True)
    assert not slow.is_fast and not (kimi_dir / "tokenizer.json").exists()
    fast = load_tokenizer(kimi_dir, trust_remote_code=True)
    assert fast.is_fast and len(fast) == len(slow) and fast.chat_template == slow.chat_template
    conversations = load_conversations(sharegpt_path(), limit=150)[0]
    texts = [m["content"] for c in conversations for m in c.messages][:400]
    texts += [slow.apply_chat_template(CONVERSATION["messages"], tokenize=False)]
    check_same_tokens(slow, fast, texts, kimi_dir)  # raises on the first difference
    # ...and the check can fail: another BPE gives other tokens
    with pytest.raises(Eagle3InputError, match="differs from it at token"):
        check_same_tokens(slow, load_tokenizer(smollm2_dir), texts[:5], kimi_dir)


def test_prepare_masks_thinking_and_tool_calls_as_the_template_renders_them(kimi_dir, tmp_path):
    from transformers import AutoTokenizer

    data = tmp_path / "c.jsonl"
    data.write_text(json.dumps(CONVERSATION) + "\n")
    manifest = prepare(data, kimi_dir, tmp_path / "prep", max_length=1024, val_count=0, trust_remote_code=True)
    tok = manifest["tokenizer"]
    assert tok["converted_from"] == "TikTokenTokenizer" and tok["vocab_file"] == "tiktoken.model"
    assert manifest["counts"]["split_at_user_turns"] == 1
    rows = {r["id"]: r for r in load_prepared(tmp_path / "prep")[0]["train"]}
    assert sorted(rows) == ["k1#turn1", "k1#turn2"]

    slow = AutoTokenizer.from_pretrained(kimi_dir, trust_remote_code=True)
    messages = CONVERSATION["messages"]
    supervised_text = []
    # sample j: the conversation up to user turn j+1, supervising the assistant turns after user turn j
    for sid, upto, supervised in (("k1#turn1", 5, (0, 1)), ("k1#turn2", 7, (2,))):
        text = slow.apply_chat_template(messages[:upto], tokenize=False)
        ids = slow.encode(text, add_special_tokens=False)  # the verifier's own tokenizer
        assert rows[sid]["input_ids"] == ids
        bodies = [(m.end(), text.index(END, m.end()) + len(END)) for m in re.finditer(re.escape(HEADER), text)]
        spans = [bodies[i] for i in supervised]
        expected, pos = [], 0
        for t in ids:  # a token is supervised when it starts inside an assistant body of the template's rendering
            piece = slow.decode([t])
            expected.append(int(any(a <= pos < b for a, b in spans)))
            pos += len(piece)
        assert pos == len(text)
        assert rows[sid]["loss_mask"] == expected, sid
        supervised_text.append(slow.decode([t for t, m in zip(ids, expected) if m]))
    for m in messages:  # every turn's reasoning and answer, and the tool call, supervised exactly once
        for piece in (m.get("reasoning_content"), m["content"] if m["role"] == "assistant" else None):
            if piece:
                assert sum(s.count(piece) for s in supervised_text) == 1, piece
    assert sum(s.count('{"city": "Paris"}') for s in supervised_text) == 1
    assert not any("18C, sunny" in s for s in supervised_text)  # the tool result is not the model's output


def test_prepared_data_is_tied_to_the_tiktoken_file(kimi_dir, tmp_path):
    data = tmp_path / "c.jsonl"
    data.write_text(json.dumps(CONVERSATION) + "\n")
    prepare(data, kimi_dir, tmp_path / "prep", val_count=0, trust_remote_code=True)
    other = tmp_path / "other"
    shutil.copytree(kimi_dir, other)
    check_prepared_tokenizer(tmp_path / "prep", other)  # same file: fine
    ranks = (other / "tiktoken.model").read_text().splitlines()
    (other / "tiktoken.model").write_text("\n".join(ranks[:-1]) + "\n")
    with pytest.raises(Eagle3InputError, match="tiktoken.model sha256"):
        check_prepared_tokenizer(tmp_path / "prep", other)
