"""A thinking model's regenerated reasoning reaches the training sample (and its loss mask), per --reasoning."""

from __future__ import annotations

import json

import pytest
from transformers import AutoTokenizer

from eagle3_train.data.chat_mask import supervised_runs
from eagle3_train.data.prepare import load_prepared, prepare
from eagle3_train.utils.io import Eagle3InputError

# A ChatML template that renders reasoning_content of the last assistant turn, as thinking-model templates do.
THINKING_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n"
    "{% if m.role == 'assistant' and m.reasoning_content and loop.last %}<think>\n{{ m.reasoning_content }}\n"
    "</think>\n\n{% endif %}{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
REASONING = "The user greets me so I greet back politely"


@pytest.fixture(scope="module")
def generated(tmp_path_factory):
    """Rows as `generate --reasoning keep` writes them."""
    path = tmp_path_factory.mktemp("gen") / "conversations.jsonl"
    rows = [{"id": f"c{i}", "messages": [{"role": "user", "content": f"Hello number {i}"},
                                         {"role": "assistant", "content": f"Hi there {i}!",
                                          "reasoning_content": f"{REASONING} {i}"}]} for i in range(4)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _supervised_text(out, verifier) -> str:
    tok = AutoTokenizer.from_pretrained(verifier)
    row = load_prepared(out)[0]["train"][0]
    return "".join(tok.decode(r) for r in supervised_runs(row["input_ids"], row["loss_mask"]))


@pytest.mark.parametrize("mode,template,inside", [
    ("auto", "smollm2", "<think>"),      # SmolLM2's template ignores reasoning_content: put back inline
    ("inline", "smollm2", "<think>"),
    ("auto", "thinking", "<think>"),     # the template renders it itself
    ("template", "thinking", "<think>"),
    ("drop", "thinking", None),
])
def test_reasoning_is_supervised_where_the_mode_puts_it(generated, tiny_llama_dir, tmp_path, mode, template, inside):
    verifier = tiny_llama_dir()
    chat_template = None
    if template == "thinking":
        chat_template = tmp_path / "thinking.jinja"
        chat_template.write_text(THINKING_TEMPLATE)
    out = tmp_path / "prepared"
    manifest = prepare(generated, verifier, out, val_count=0, reasoning=mode, chat_template=chat_template)
    text = _supervised_text(out, verifier)
    assert manifest["counts"]["assistant_turns_with_reasoning"] == 4
    assert manifest["settings"]["template_renders_reasoning"] == (template == "thinking")
    if inside:
        assert REASONING in text and inside in text and "Hi there" in text
    else:
        assert REASONING not in text and "Hi there" in text


def test_template_mode_refuses_a_template_that_would_drop_reasoning(generated, tiny_llama_dir, tmp_path):
    with pytest.raises(Eagle3InputError, match="ignores it"):
        prepare(generated, tiny_llama_dir(), tmp_path / "p", val_count=0, reasoning="template")
