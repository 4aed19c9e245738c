"""The README's commands parse, and those of the guides it links to (docs/KIMI.md, docs/LARGE_VERIFIERS.md,
docs/GUIDE.md): every `eagle3-train ...` line of their code blocks (continuation lines joined) is parsed by the real
CLI parser, and every setting it passes with `--set`/`--vllm-arg` keeps its shape. A renamed or
retired flag in a recipe is a failure here, not a user's first error at hour three."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

from eagle3_train.cli import build_parser

ROOT = Path(__file__).resolve().parents[2]
DOCS = [ROOT / "README.md", ROOT / "docs" / "KIMI.md", ROOT / "docs" / "LARGE_VERIFIERS.md", ROOT / "docs" / "GUIDE.md",
        ROOT / "docs" / "RECIPES.md", ROOT / "docs" / "INSTALL.md"]


def _commands() -> list[str]:
    blocks, block = [], None
    for line in (line for doc in DOCS for line in doc.read_text().splitlines()):
        if line.startswith("```"):
            if block is None:
                block = []
            else:
                blocks.append("\n".join(block))
                block = None
        elif block is not None:
            block.append(line)
    out = []
    for block in blocks:
        joined = re.sub(r"\\\n\s*", " ", block)
        for line in joined.splitlines():
            line = line.strip()
            for prefix in ("torchrun --nproc-per-node 8 -m eagle3_train.cli ", "eagle3-train ", "$ eagle3-train "):
                if line.startswith(prefix):
                    out.append(line[len(prefix):].split(" #")[0])
    return out


COMMANDS = _commands()


def test_the_readme_has_its_recipes():
    stages = {shlex.split(c)[0] for c in COMMANDS}
    assert {"generate", "prepare", "vocab", "plan", "serve", "extract", "train", "export"} <= stages, stages


@pytest.mark.parametrize("command", COMMANDS)
def test_a_readme_command_parses(command, capsys):
    argv = shlex.split(command)
    try:
        build_parser(argv).parse_args(argv)
    except SystemExit as e:  # --version and --help exit 0 after printing
        if e.code == 0:
            return
        pytest.fail(f"`eagle3-train {command}` does not parse: {capsys.readouterr().err.strip()} (exit {e.code})")
