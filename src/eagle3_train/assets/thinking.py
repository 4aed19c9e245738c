"""How each thinking-model family switches its reasoning on and off, and the sampling its makers recommend.

`generate` regenerates a thinking verifier's answers through its server: turning thinking off (`--reasoning disable`)
is a different request per family, and a draft should learn the distribution the model is served at, so the
recommended sampling is recorded beside the sampling used (and a difference is warned about). The style is found
from the chat template when the model's files can be read (the variable the template reads), else from the served
model's name; `generate.thinking_style` names it when neither tells.

`python -m eagle3_train.assets.thinking --markdown` prints the table (docs/KIMI.md, "Thinking").
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

ThinkingStyleName = Literal["auto", "kimi", "qwen3", "deepseek", "gpt_oss", "generic"]


@dataclass(frozen=True)
class Sampling:
    temperature: float
    top_p: float = 1.0

    def to_dict(self) -> dict[str, float]:
        return {"temperature": self.temperature, "top_p": self.top_p}


@dataclass(frozen=True)
class ThinkingStyle:
    name: str
    names: tuple[str, ...]  # lower-case substrings of a served model name or path
    template_marker: str  # the variable its chat template reads (how a template is recognised)
    off: dict[str, Any]  # request fields that turn thinking off
    on: dict[str, Any] = field(default_factory=dict)  # request fields that turn it on (where it is off by default)
    thinking: Sampling | None = None  # recommended sampling with thinking on; None: no recommendation known
    instant: Sampling | None = None  # ... with thinking off
    source: str = ""
    # vLLM's tool-call parser for the family's chat format (`--tool-call-parser`): what turns a new call back into
    # `tool_calls`; None: none known (a server started here without one cannot take the conversations' tools)
    tool_parser: str | None = None

    def tool_server_args(self) -> list[str]:
        """The vLLM flags that let a server return this family's tool calls, where its parser is known."""
        return ["--enable-auto-tool-choice", "--tool-call-parser", self.tool_parser] if self.tool_parser else []

    def request_extra(self, reasoning: str) -> dict[str, Any] | None:
        """The extra request body for generate's reasoning mode (keep/strip: thinking on; disable: off)."""
        extra = self.off if reasoning == "disable" else self.on
        return dict(extra) or None

    def recommended(self, reasoning: str) -> Sampling | None:
        return self.instant if reasoning == "disable" else self.thinking


STYLES: tuple[ThinkingStyle, ...] = (
    ThinkingStyle("kimi", ("kimi",), "thinking", off={"chat_template_kwargs": {"thinking": False}},
                  thinking=Sampling(1.0, 0.95), instant=Sampling(0.6, 0.95),
                  source="Kimi-K2.5 model card and vLLM recipe: thinking on by default, chat_template_kwargs.thinking",
                  tool_parser="kimi_k2"),
    ThinkingStyle("qwen3", ("qwen3",), "enable_thinking", off={"chat_template_kwargs": {"enable_thinking": False}},
                  thinking=Sampling(0.6, 0.95), instant=Sampling(0.7, 0.8),
                  source="Qwen3 model cards (also top_k 20): enable_thinking, on by default", tool_parser="hermes"),
    ThinkingStyle("deepseek", ("deepseek",), "thinking", off={"chat_template_kwargs": {"thinking": False}},
                  on={"chat_template_kwargs": {"thinking": True}}, thinking=Sampling(0.6, 0.95),
                  source="DeepSeek-V3.1 template: thinking off unless chat_template_kwargs.thinking; R1's sampling",
                  tool_parser="deepseek_v31"),
    ThinkingStyle("gpt_oss", ("gpt-oss", "gpt_oss"), "reasoning_effort", off={"reasoning_effort": "low"},
                  thinking=Sampling(1.0, 1.0), instant=Sampling(1.0, 1.0),
                  source="gpt-oss model card: reasoning cannot be turned off, `disable` asks for low effort",
                  tool_parser="openai"),
)
# An unknown template: Qwen3's switch (templates that do not read it ignore it), no sampling recommendation.
GENERIC = ThinkingStyle("generic", (), "", off={"chat_template_kwargs": {"enable_thinking": False}},
                        source="unknown template: Qwen3's switch is sent, which other templates ignore")
_BY_NAME = {s.name: s for s in (*STYLES, GENERIC)}


def chat_template_text(model_dir: Path) -> str | None:
    """The chat template shipped with a local model directory (tokenizer_config.json or chat_template.jinja)."""
    import json

    jinja = model_dir / "chat_template.jinja"
    if jinja.is_file():
        return jinja.read_text(encoding="utf-8", errors="replace")
    config = model_dir / "tokenizer_config.json"
    if config.is_file():
        try:
            template = json.loads(config.read_text(encoding="utf-8")).get("chat_template")
        except (json.JSONDecodeError, UnicodeDecodeError):
            return None
        if isinstance(template, list):  # named templates: the default one
            template = next((t.get("template") for t in template if t.get("name") == "default"), None)
        return template if isinstance(template, str) else None
    return None


def style_from_template(template: str) -> ThinkingStyle | None:
    if "reasoning_effort" in template:
        return _BY_NAME["gpt_oss"]
    if "enable_thinking" in template:
        return _BY_NAME["qwen3"]
    return None  # Kimi's and DeepSeek's templates both read `thinking`: the name tells them apart


def style_from_name(name: str) -> ThinkingStyle | None:
    lowered = name.lower()
    return next((s for s in STYLES if any(n in lowered for n in s.names)), None)


def resolve_style(setting: str, model_name: str, model_dir: str | Path | None = None) -> tuple[ThinkingStyle, str]:
    """(style, how it was found) for generate's `thinking_style` setting and the served model."""
    if setting != "auto":
        if setting not in _BY_NAME:
            raise ValueError(f"thinking_style must be auto or one of {sorted(_BY_NAME)}, got {setting!r}")
        return _BY_NAME[setting], "setting"
    names = [model_name] + ([str(model_dir)] if model_dir else [])
    template = chat_template_text(Path(model_dir)) if model_dir and Path(model_dir).is_dir() else None
    if template is not None:
        by_template = style_from_template(template)
        if by_template is not None:
            return by_template, "chat template"
        if "thinking" in template:
            for name in names:
                if (s := style_from_name(name)) is not None and s.template_marker == "thinking":
                    return s, "chat template and model name"
    for name in names:
        if (s := style_from_name(name)) is not None:
            return s, "model name"
    return GENERIC, "no known style"


def markdown_table() -> str:
    def fmt(s: Sampling | None) -> str:
        return f"T {s.temperature}, top-p {s.top_p}" if s else "none known"

    rows = ["| style | recognised by | thinking off (`--reasoning disable`) | thinking on | sampling, thinking | "
            "sampling, instant | vLLM tool-call parser | source |", "|---|---|---|---|---|---|---|---|"]
    for s in (*STYLES, GENERIC):
        seen = f"template reads `{s.template_marker}`; name contains {', '.join(s.names)}" if s.names else "otherwise"
        rows.append(f"| {s.name} | {seen} | `{s.off}` | `{s.on or 'default'}` | {fmt(s.thinking)} | "
                    f"{fmt(s.instant)} | {f'`{s.tool_parser}`' if s.tool_parser else 'none known'} | {s.source} |")
    return "\n".join(rows)


if __name__ == "__main__" and "--markdown" in sys.argv:
    print(markdown_table())
