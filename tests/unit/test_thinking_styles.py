"""The thinking-style table: how a served verifier's reasoning is switched, found from its chat template or name, and
what generate does with a reply whose reasoning is inline or cut."""

from __future__ import annotations

import json

import pytest

from eagle3_train.assets.thinking import GENERIC, STYLES, markdown_table, resolve_style
from eagle3_train.generate.conversation import split_inline_reasoning
from eagle3_train.generate.run_settings import DEFAULT_MAX_TOKENS, THINKING_MAX_TOKENS, default_max_tokens
from eagle3_train.testing.kimi_tokenizer import CHAT_TEMPLATE as KIMI_TEMPLATE

QWEN3_LIKE = "{%- if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>{% endif %}"
GPT_OSS_LIKE = "{%- if reasoning_effort is defined %}Reasoning: {{ reasoning_effort }}{% endif %}"


def model_dir(tmp_path, template: str, name: str = "model"):
    d = tmp_path / name
    d.mkdir()
    (d / "tokenizer_config.json").write_text(json.dumps({"chat_template": template}))
    return d


@pytest.mark.parametrize(("template", "name", "style", "found_by"), [
    (QWEN3_LIKE, "my-finetune", "qwen3", "chat template"),
    (GPT_OSS_LIKE, "served", "gpt_oss", "chat template"),
    (KIMI_TEMPLATE, "Kimi-sim", "kimi", "chat template and model name"),
    (KIMI_TEMPLATE, "DeepSeek-V3.1", "deepseek", "chat template and model name"),
    ("{{ messages }}", "Qwen3-8B", "qwen3", "model name"),  # a template without a switch: the name decides
    ("{{ messages }}", "SmolLM2-135M-Instruct", "generic", "no known style"),
])
def test_style_found_from_the_template_then_the_name(tmp_path, template, name, style, found_by):
    d = model_dir(tmp_path, template, name)
    got, how = resolve_style("auto", "served-name", d)
    assert (got.name, how) == (style, found_by)


def test_style_from_the_served_name_alone_and_by_setting():
    assert resolve_style("auto", "moonshotai/Kimi-K2.5", None)[0].name == "kimi"
    assert resolve_style("auto", "openai/gpt-oss-120b", "/not/here")[0].name == "gpt_oss"
    assert resolve_style("deepseek", "whatever", None) == (STYLES[2], "setting")
    with pytest.raises(ValueError, match="thinking_style must be auto or one of"):
        resolve_style("glm", "whatever", None)


def test_each_style_switches_thinking_its_own_way():
    kimi, qwen3, deepseek, gpt_oss = STYLES
    assert kimi.request_extra("disable") == {"chat_template_kwargs": {"thinking": False}}
    assert kimi.request_extra("keep") is None  # on by default
    assert qwen3.request_extra("disable") == {"chat_template_kwargs": {"enable_thinking": False}}
    assert deepseek.request_extra("keep") == {"chat_template_kwargs": {"thinking": True}}  # off by default
    assert gpt_oss.request_extra("disable") == {"reasoning_effort": "low"}
    assert kimi.recommended("keep").temperature == 1.0 and kimi.recommended("disable").temperature == 0.6
    assert GENERIC.recommended("keep") is None
    assert all(f"| {s.name} |" in markdown_table() for s in (*STYLES, GENERIC))


def test_max_tokens_default_is_sized_for_reasoning():
    kimi = STYLES[0]
    assert default_max_tokens(GENERIC, "keep", 4096)[0] == DEFAULT_MAX_TOKENS
    assert default_max_tokens(kimi, "disable", 262144)[0] == DEFAULT_MAX_TOKENS
    assert default_max_tokens(kimi, "keep", 262144)[0] == THINKING_MAX_TOKENS
    assert default_max_tokens(kimi, "keep", 8192)[0] == 4096


@pytest.mark.parametrize(("content", "answer", "reasoning"), [
    ("<think>\nstep 1\n</think>\n\nThe answer.", "The answer.", "step 1"),
    ("  <think>cut in the midd", "", "cut in the midd"),  # cut at max_tokens inside the reasoning
    ("No reasoning here.", "No reasoning here.", None),
    ("Text then <think>late</think>", "Text then <think>late</think>", None),  # only leading reasoning is split
])
def test_inline_reasoning_is_split_off(content, answer, reasoning):
    assert split_inline_reasoning(content) == (answer, reasoning)


def test_the_docs_table_is_current():
    from pathlib import Path

    doc = (Path(__file__).resolve().parents[2] / "docs" / "VERIFIER_FAMILIES.md").read_text()
    assert markdown_table() in doc, "docs/VERIFIER_FAMILIES.md is stale: python -m eagle3_train.assets.thinking " \
                                    "--markdown"


def test_a_server_started_for_conversations_with_tools_gets_the_familys_tool_parser(tmp_path):
    """generate starts vLLM with the style's tool-call parser when (and only when) the conversations offer tools."""
    import json

    from eagle3_train.generate.conversation import tool_server_args

    plain = tmp_path / "plain.jsonl"
    plain.write_text(json.dumps({"messages": [{"role": "user", "content": "q"},
                                              {"role": "assistant", "content": "a"}]}) + "\n")
    tools = tmp_path / "tools.jsonl"
    tools.write_text(json.dumps({"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}],
                                 "tools": [{"type": "function", "function": {"name": "f"}}]}) + "\n")
    assert tool_server_args(plain, "moonshotai/Kimi-K2.5", None) == []
    assert tool_server_args(tools, "moonshotai/Kimi-K2.5", None) == ["--enable-auto-tool-choice",
                                                                     "--tool-call-parser", "kimi_k2"]
    assert tool_server_args(tools, "Qwen/Qwen3-8B", None)[-1] == "hermes"
    assert tool_server_args(tools, "some-model", None) == []  # none known: the server's refusal names the flags
