#!/usr/bin/env python
"""Reliability campaign: kill -9 at random points, bad inputs, and load, against the real CLI (issue 12).

    python scripts/reliability_campaign.py [--short] [--stages kill-extract,kill-train,...] [--seed N] [--out DIR]

Every check runs `python -m eagle3_train.cli ...` as a user would, on a tiny random Llama verifier (hidden 64,
4 layers, the SmolLM2 tokenizer) so that a full campaign takes minutes on CPU:

- kill-*: each stage (generate, extract, train, the whole `run`) is killed with SIGKILL at seeded random times
  (>= 10 kills per stage, 1-2 with --short), rerun until it finishes, and its outputs are compared with an
  uninterrupted run: shards tensor by tensor, weights bit for bit, generated rows record by record. Files left in
  the output that the uninterrupted run does not have (temporary files, half checkpoints) are reported.
- inputs: one bad input per row; the expected handling is one clear error (exit code 2, no traceback, naming the
  file/field) or a counted skip.
- ownership: commands pointed at the user's own files (a foreign --out with --overwrite, look-alike siblings,
  the data inside --out, a symlinked --out, a second writer, a hostile hidden-state endpoint); `lost` counts the
  user's files that are missing or changed afterwards (must be 0).
- load: `generate` through a proxy that answers slowly and drops connections, 64 requests in flight, against a local
  OpenAI-compatible server whose own throughput is measured first.

Generation uses a real vLLM CPU server (SmolLM2) when the vLLM environment exists, else a small local
OpenAI-compatible server (rows say which). Results: OUT/results.json, OUT/results.md and (full runs, or --docs)
docs/RELIABILITY.md. Exit code 1 when a row fails its expectation.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hashlib
import json
import os
import random
import resource
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))
PY = sys.executable
TINY_LLAMA = {"hidden_size": 64, "num_attention_heads": 2, "num_key_value_heads": 2, "head_dim": 32,
              "num_hidden_layers": 4, "intermediate_size": 128, "vocab_size": 49152, "max_position_embeddings": 4096,
              "rms_norm_eps": 1e-5, "rope_theta": 100000.0, "tie_word_embeddings": True, "bos_token_id": 1,
              "eos_token_id": 2, "pad_token_id": 2, "initializer_range": 0.5}
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "special_tokens_map.json")
STAGES = ("kill-extract", "kill-train", "kill-run", "kill-generate", "inputs", "ownership", "replies", "load")
# Files whose content legitimately differs between two runs (clock, host): compared by name only.
VOLATILE = ("manifest.json", "training_metadata.json", "metrics.jsonl", "metrics.png", "pipeline_state.json",
            "pipeline_config.json", "summary.json", "vllm.log")


# --- results --------------------------------------------------------------------------------------------------
@dataclass
class Row:
    stage: str
    fault: str
    expected: str
    handled: str = ""
    ok: bool = False
    lost: int | None = 0  # outputs of the uninterrupted run missing or different at the end (must be 0)
    command: str = ""
    seconds: float = 0.0
    details: dict[str, Any] = field(default_factory=dict)


class Campaign:
    def __init__(self, out: Path, seed: int, short: bool) -> None:
        self.out, self.seed, self.short = out, seed, short
        self.rows: list[Row] = []
        self.rng = random.Random(seed)
        self.env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO / "src"),
                                                                                 os.environ.get("PYTHONPATH")])),
                    "EAGLE3_TRAIN_NO_PROGRESS": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
                    "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "2"),
                    # Outputs are compared bit for bit across processes: MKL may otherwise pick a GEMM code path by
                    # memory alignment, which differs between a resumed process and the uninterrupted one.
                    "MKL_CBWR": os.environ.get("MKL_CBWR", "AUTO,STRICT")}
        self.kills = 2 if short else 10
        self.started = time.strftime("%Y-%m-%d %H:%M", time.gmtime())
        self.t0 = time.monotonic()
        self.stages: list[str] = []
        self.only: list[str] = []  # --only: run just the input rows whose fault contains one of these

    def wanted(self, fault: str) -> bool:
        return not self.only or any(o.lower() in fault.lower() for o in self.only)

    def save(self) -> str:
        """Write OUT/results.json and OUT/results.md (after every row: a campaign stopped early keeps its rows)."""
        seconds = time.monotonic() - self.t0
        table = markdown(self, self.started, seconds, self.stages)
        (self.out / "results.json").write_text(json.dumps({
            "started": self.started, "seconds": round(seconds, 1), "short": self.short, "seed": self.seed,
            "stages": self.stages, "rows": [asdict(r) for r in self.rows]}, indent=1))
        (self.out / "results.md").write_text(table)
        return table

    def add(self, row: Row) -> Row:
        self.rows.append(row)
        self.save()
        mark = "ok  " if row.ok else "FAIL"
        print(f"[{mark}] {row.stage}: {row.fault} -> {row.handled[:160]} (lost {row.lost}, {row.seconds:.0f} s)",
              flush=True)
        return row

    # --- subprocesses -----------------------------------------------------------------------------------------
    def cli(self, *args: str) -> list[str]:
        return [PY, "-m", "eagle3_train.cli", *map(str, args)]

    def run(self, cmd: list[str], timeout: float = 1800, preexec: Callable[[], None] | None = None,
            env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env or self.env,
                              preexec_fn=preexec, errors="replace")

    def run_killed_at(self, cmd: list[str], reached: Callable[[], bool], jitter: float) -> bool:
        """Start `cmd`; SIGKILL it `jitter` s after `reached()` turns true. False when it ended first."""
        proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=self.env,
                                start_new_session=True)
        while proc.poll() is None and not reached():
            time.sleep(0.02)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=jitter)
        if proc.poll() is not None:
            return False
        proc.kill()  # SIGKILL to the process only, as `kill -9 PID` would
        proc.wait()
        with contextlib.suppress(ProcessLookupError):  # anything it started (none expected) goes too
            os.killpg(proc.pid, signal.SIGKILL)
        return True


def command_text(cmd: list[str]) -> str:
    parts = ["eagle3-train", *cmd[3:]] if cmd[:3] == [PY, "-m", "eagle3_train.cli"] else cmd
    return " ".join(str(p) for p in parts)


def error_excerpt(r: subprocess.CompletedProcess) -> str:
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    errs = [ln for ln in lines if "error:" in ln]
    return (errs[-1] if errs else (lines[-1] if lines else r.stdout.strip()[-200:]))[:300]


def clean_error(r: subprocess.CompletedProcess, *must: str) -> tuple[bool, str]:
    """Exit code 2, no traceback, and the message names what it must (file, field)."""
    text = error_excerpt(r)
    ok = r.returncode == 2 and "Traceback" not in r.stderr and all(m.lower() in r.stderr.lower() for m in must)
    prefix = "" if r.returncode == 2 else f"exit {r.returncode}{' with traceback' if 'Traceback' in r.stderr else ''}: "
    return ok, prefix + text


def tree(root: Path) -> dict[str, int]:
    """Relative path -> size of every file under root."""
    if not root.exists():
        return {}
    return {str(p.relative_to(root)): p.stat().st_size for p in sorted(root.rglob("*")) if p.is_file()}


def leftovers(ref: Path, got: Path, ignore: tuple[str, ...] = ()) -> list[str]:
    """Files in `got` the uninterrupted run does not have (what a killed run left behind)."""
    extra = sorted(set(tree(got)) - set(tree(ref)))
    return [e for e in extra if not any(part in e for part in ignore)]


def tensors_equal(a: Path, b: Path) -> list[str]:
    """Names of tensors (and '<metadata>') that differ between two safetensors files (or ['<missing file>']).

    Not the file bytes: safetensors writes its metadata map in a random key order, so equal files can hash apart.
    """
    import torch
    from safetensors import safe_open

    if not b.is_file():
        return ["<missing file>"]
    with safe_open(str(a), "pt") as fa, safe_open(str(b), "pt") as fb:
        diff = [] if fa.metadata() == fb.metadata() else ["<metadata>"]
        ka, kb = set(fa.keys()), set(fb.keys())  # noqa: SIM118 - safe_open has no __iter__
        diff += sorted(ka ^ kb)
        for k in sorted(ka & kb):
            x, y = fa.get_tensor(k), fb.get_tensor(k)
            if not (x.dtype == y.dtype and torch.equal(x, y)):
                diff.append(k)
    return diff


# --- assets ---------------------------------------------------------------------------------------------------
def tiny_llama(out: Path, seed: int = 0, vocab_extra: int = 0, add_token: bool = False,
               drop_template: bool = False, hidden: int = 64) -> Path:
    """A tiny random Llama with the SmolLM2 tokenizer (as tests/conftest.py `tiny_llama_dir`)."""
    if (out / "config.json").is_file():
        return out
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from eagle3_train.assets.verifier import resolve_verifier

    smol = resolve_verifier("smollm2-135m-instruct")
    settings = {**TINY_LLAMA, "vocab_size": TINY_LLAMA["vocab_size"] + vocab_extra, "hidden_size": hidden}
    torch.manual_seed(seed)
    config = LlamaConfig(**settings)
    config.architectures = ["LlamaForCausalLM"]
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    LlamaForCausalLM(config).to(torch.float32).eval().save_pretrained(tmp, safe_serialization=True)
    for name in TOKENIZER_FILES:
        if (smol / name).is_file() and not (drop_template and name == "chat_template.jinja"):
            shutil.copy2(smol / name, tmp / name)
    if drop_template:
        tc = json.loads((tmp / "tokenizer_config.json").read_text())
        tc.pop("chat_template", None)
        (tmp / "tokenizer_config.json").write_text(json.dumps(tc, indent=1))
    if add_token:  # another tokenizer: one more (special) token, so its tokenizer.json hash differs
        tj = json.loads((tmp / "tokenizer.json").read_text())
        new_id = TINY_LLAMA["vocab_size"] + vocab_extra - 1
        tj["added_tokens"].append({"id": new_id, "content": "<|campaign|>", "single_word": False, "lstrip": False,
                                   "rstrip": False, "normalized": False, "special": True})
        (tmp / "tokenizer.json").write_text(json.dumps(tj))
    tmp.rename(out)
    return out


def conversations_file(path: Path, n: int, offset: int = 0) -> Path:
    """The first n ShareGPT conversations (after `offset`) with one user and one assistant turn, as JSONL."""
    from eagle3_train.assets.conversation_records import normalize_turns
    from eagle3_train.assets.conversations import load_conversations

    rows = []
    it, _ = load_conversations("sharegpt", limit=(n + offset) * 3)
    for conv in it:
        msgs, reason = normalize_turns(conv.messages)
        if reason or msgs[0]["role"] != "user" or len(msgs[0]["content"]) > 2000:
            continue
        rows.append({"id": conv.id, "messages": msgs[:2]})
    rows = rows[offset:offset + n]
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))
    return path


@dataclass
class Assets:
    root: Path
    verifier: Path
    source: Path
    prepared: Path
    vocab: Path
    hidden: Path


def build_assets(c: Campaign) -> Assets:
    root = c.out / "assets"
    root.mkdir(parents=True, exist_ok=True)
    verifier = tiny_llama(root / "tiny-llama")
    source = root / "source.jsonl"
    if not source.is_file():
        conversations_file(source, 24)
    a = Assets(root, verifier, source, root / "prepared", root / "vocab", root / "hidden")
    steps = [
        (a.prepared / "manifest.json", c.cli("prepare", "--data", source, "--verifier", verifier, "--out", a.prepared,
                                             "--max-length", "160", "--val-count", "3")),
        (a.vocab / "vocab.safetensors", c.cli("vocab", "--prepared", a.prepared, "--out", a.vocab, "--size", "1024")),
        (a.hidden / "manifest.json", extract_cmd(c, a, a.hidden)),
    ]
    for marker, cmd in steps:
        if not marker.is_file():
            r = c.run(cmd)
            if r.returncode != 0:
                raise SystemExit(f"setting up the campaign failed: {command_text(cmd)}\n{r.stderr[-3000:]}")
    return a


def extract_cmd(c: Campaign, a: Assets, out: Path) -> list[str]:
    return c.cli("extract", "--prepared", a.prepared, "--verifier", a.verifier, "--out", out, "--dtype", "float32",
                 "--token-budget", "256", "--shard-tokens", "160")


def train_cmd(c: Campaign, a: Assets, out: Path, hidden: Path | None = None, extra: tuple[str, ...] = ()) -> list[str]:
    return c.cli("train", "--prepared", a.prepared, "--hidden-states", hidden or a.hidden, "--vocab", a.vocab,
                 "--out", out, "--ttt-steps", "2", "--epochs", "3", "--token-budget", "192", "--lr", "3e-3",
                 "--save-every", "3", "--log-every", "1", "--seed", "0", "--set", "train.tensorboard=false",
                 "--resume", *extra)


# --- kill -9 --------------------------------------------------------------------------------------------------
def kill_stage(c: Campaign, stage: str, cmd: list[str], out: Path, progress: Callable[[Path], int],
               compare: Callable[[Path, Path], list[str]], state: Callable[[Path], str],
               ignore: tuple[str, ...] = ()) -> None:
    """Reference run, then trials: kill once or more at random points, rerun to the end, compare.

    A kill point is a seeded random progress count (shards, logged steps, rows, stages; 0 = start-up) plus a random
    delay of up to a second, so kills land as often in a write as between writes, however fast the machine is.
    """
    ref = out.with_name(out.name + "-reference")
    work = out
    shutil.rmtree(ref, ignore_errors=True)
    ref_cmd = [str(ref) if a == str(out) else a for a in cmd]
    t0 = time.monotonic()
    r = c.run(ref_cmd)
    total = time.monotonic() - t0
    if r.returncode != 0:
        c.add(Row(stage, "uninterrupted reference run", "exit 0", f"exit {r.returncode}: {error_excerpt(r)}", False,
                  None, command_text(ref_cmd), total))
        return
    final = progress(ref)
    kills, trials, t_start = 0, 0, time.monotonic()
    while kills < c.kills and trials < 3 * c.kills:
        trials += 1
        shutil.rmtree(work, ignore_errors=True)
        chain = 1 + c.rng.randrange(3)  # kill the resumed run too, up to three kills before the run may finish
        points, states = [], []
        for _ in range(chain):
            target, jitter = c.rng.randrange(max(1, final)), c.rng.uniform(0.0, 1.0)
            if not c.run_killed_at(cmd, lambda target=target: progress(work) >= target, jitter):
                break
            kills += 1
            points.append(f"progress {target}/{final} + {jitter:.2f} s")
            states.append(state(work))
        t1 = time.monotonic()
        r = c.run(cmd)
        diffs = compare(ref, work) if r.returncode == 0 else ["<resumed run failed>"]
        extra = leftovers(ref, work, ignore)
        ok = r.returncode == 0 and not diffs and not extra
        handled = (f"killed at {'; '.join(f'{p} ({s})' for p, s in zip(points, states))}; rerun exit {r.returncode}"
                   + (f": {error_excerpt(r)}" if r.returncode else "")
                   + (f"; differs: {diffs[:5]}" if diffs else "; outputs identical")
                   + (f"; left behind: {extra[:5]}" if extra else ""))
        if points:
            c.add(Row(stage, f"kill -9 x{len(points)} (trial {trials})", "rerun resumes; outputs identical to an "
                      "uninterrupted run; nothing of the killed run left", handled, ok, len(diffs),
                      command_text(cmd) + f"  # kill -9 at {points}, then rerun", time.monotonic() - t1,
                      {"points": points, "states": states, "reference_s": round(total, 1)}))
    print(f"  {stage}: {kills} kills in {trials} trials, {time.monotonic() - t_start:.0f} s", flush=True)


def compare_extract(ref: Path, got: Path) -> list[str]:
    diffs = []
    for split in ("train", "validation"):
        ri = json.loads((ref / split / "index.json").read_text())
        gi_path = got / split / "index.json"
        gi = json.loads(gi_path.read_text()) if gi_path.is_file() else {"shards": []}
        if not gi.get("complete"):
            diffs.append(f"{split}: index not complete")
        g_by = {e["shard"]: e for e in gi["shards"]}
        for e in ri["shards"]:
            name = f"{split}/{e['file']}"
            same = {k: v for k, v in e.items() if k != "sha256"}  # hashes: see tensors_equal
            if e["shard"] not in g_by or {k: v for k, v in g_by[e["shard"]].items() if k != "sha256"} != same:
                diffs.append(f"{name}: index entry differs")
            diffs += [f"{name}:{t}" for t in tensors_equal(ref / split / e["file"], got / split / e["file"])]
    return diffs


def shard_state(out: Path) -> str:
    return f"{len(list(out.glob('*/shard-*.safetensors')))} shards written"


def compare_train(ref: Path, got: Path) -> list[str]:
    final = "final/model.safetensors"
    diffs = [f"final:{t}" for t in tensors_equal(ref / final, got / final)]
    for d in sorted((ref / "checkpoints").glob("*")):
        if d.is_dir():
            diffs += [f"{d.name}:{t}" for t in tensors_equal(d / "model.safetensors",
                                                              got / "checkpoints" / d.name / "model.safetensors")]

    def metrics(p: Path) -> list[dict]:
        if not p.is_file():
            return []
        return [{k: v for k, v in json.loads(ln).items() if k not in ("time", "tokens_per_s")}
                for ln in p.read_text().splitlines() if ln.strip()]

    want, have = metrics(ref / "metrics.jsonl"), metrics(got / "metrics.jsonl")
    if want != have:
        at = next((i for i, (w, h) in enumerate(zip(want, have)) if w != h), min(len(want), len(have)))
        keys = sorted(k for k in set(want[at]) | set(have[at]) if want[at].get(k) != have[at].get(k)) \
            if at < min(len(want), len(have)) else []
        diffs.append(f"metrics.jsonl (losses/accuracies per step) differ: {len(want)} vs {len(have)} lines, "
                     f"first at line {at + 1}" + (f" in {keys}: {[want[at].get(k) for k in keys]} vs "
                                                   f"{[have[at].get(k) for k in keys]}" if keys else ""))
    return diffs


def ckpt_state(out: Path) -> str:
    steps = sorted(p.name for p in (out / "checkpoints").glob("step-*"))
    return f"checkpoints {steps[-1] if steps else 'none'}"


def run_config(c: Campaign, a: Assets, run_dir: Path) -> Path:
    cfg = c.out / "assets" / "tiny-run.yaml"
    cfg.write_text(json.dumps({  # JSON is YAML
        "run_dir": str(run_dir), "verifier": str(a.verifier),
        "prepare": {"data": str(a.source), "max_length": 160, "val_count": 2, "limit": 12},
        "vocab": {"size": 1024}, "extract": {"dtype": "float32", "token_budget": 256, "shard_tokens": 160},
        "train": {"ttt_steps": 2, "epochs": 1, "token_budget": 192, "lr": 3e-3, "save_every": 3, "log_every": 1,
                  "seed": 0, "tensorboard": False},
        "export": {"formats": ["eagle"], "dtype": "float32"}, "evaluate": {"vllm": False, "offline": False}}))
    return cfg


def compare_run(ref: Path, got: Path) -> list[str]:
    diffs = compare_train(ref / "train", got / "train")
    diffs += [f"export:{t}" for t in tensors_equal(ref / "export-eagle" / "model.safetensors",
                                                   got / "export-eagle" / "model.safetensors")]
    diffs += [f"hidden_states/{d}" for d in compare_extract(ref / "hidden_states", got / "hidden_states")]
    aside = [p.name for p in got.glob("*.previous-*")]
    return diffs + [f"set aside: {aside}"] if aside else diffs


def lines(name: str) -> Callable[[Path], int]:
    def count(out: Path) -> int:
        with contextlib.suppress(OSError):
            return (out / name).read_bytes().count(b"\n")
        return 0
    return count


def run_progress(out: Path) -> int:
    """Stages done, then the training steps logged: enough points to kill every stage of the pipeline."""
    with contextlib.suppress(OSError, ValueError):
        stages = len(json.loads((out / "pipeline_state.json").read_text()).get("stages", {}))
        return stages * 10 + lines("metrics.jsonl")(out / "train")
    return 0


def run_state(out: Path) -> str:
    p = out / "pipeline_state.json"
    done = list(json.loads(p.read_text()).get("stages", {})) if p.is_file() else []
    return f"stages done {done}"


def kill_extract(c: Campaign, a: Assets) -> None:
    out = c.out / "kill" / "extract"
    kill_stage(c, "extract", extract_cmd(c, a, out), out,
               lambda p: len(list(p.glob("*/shard-*.safetensors"))), compare_extract, shard_state)


def kill_train(c: Campaign, a: Assets) -> None:
    out = c.out / "kill" / "train"
    kill_stage(c, "train", train_cmd(c, a, out), out, lines("metrics.jsonl"), compare_train, ckpt_state)


def kill_run(c: Campaign, a: Assets) -> None:
    out = c.out / "kill" / "run"
    ref = out.with_name(out.name + "-reference")
    cfg = run_config(c, a, out)
    # The reference run gets its run_dir with --run-dir (kill_stage swaps the `out` argument).
    cmd = c.cli("run", "--config", cfg, "--run-dir", out)
    del ref
    kill_stage(c, "run", cmd, out, run_progress, compare_run, run_state, ignore=("generate-source",))


# --- a local OpenAI-compatible server and a faulty proxy --------------------------------------------------------
class FakeServer:
    """Deterministic chat completions with a fixed number of slots and a service time (its own throughput is
    slots / service_s). mode: ok | 500 (every chat request fails)."""

    def __init__(self, slots: int = 8, service_s: float = 0.25, mode: str = "ok", model: str = "fake",
                 root: str | None = None) -> None:
        from aiohttp import web

        self.mode, self.model, self.served = mode, model, 0
        self.loop = asyncio.new_event_loop()
        sem: list[asyncio.Semaphore] = []

        async def models(request: web.Request) -> web.Response:  # `root`: the checkpoint vLLM names
            card = {"id": model, "object": "model", **({"root": root} if root else {})}
            return web.json_response({"object": "list", "data": [card]})

        async def chat(request: web.Request) -> web.Response:
            body = await request.json()
            if self.mode == "500":
                return web.json_response({"error": {"message": "internal error", "code": 500}}, status=500)
            if not sem:
                sem.append(asyncio.Semaphore(slots))
            async with sem[0]:
                await asyncio.sleep(service_s)
            self.served += 1
            digest = hashlib.sha256(json.dumps(body["messages"], sort_keys=True).encode()).hexdigest()
            text = f"answer {digest[:16]}"
            return web.json_response({
                "id": "x", "object": "chat.completion", "created": 0, "model": model,
                "choices": [{"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": "stop"}],
                "usage": {"prompt_tokens": 10, "completion_tokens": 3, "total_tokens": 13}})

        app = web.Application()
        app.router.add_get("/v1/models", models)
        app.router.add_post("/v1/chat/completions", chat)
        self._start(app)

    def _start(self, app: Any) -> None:
        from aiohttp import web

        self.runner = web.AppRunner(app, access_log=None)
        self.loop.run_until_complete(self.runner.setup())
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        self.loop.run_until_complete(site.start())
        self.root = f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"
        self.url = self.root + "/v1"
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        asyncio.run_coroutine_threadsafe(self.runner.cleanup(), self.loop).result(30)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(30)


# Replies an endpoint should never give, each read by `generate` as a counted skip or a stop, never a traceback.
HOSTILE_REPLIES: dict[str, Any] = {
    "reasoning-object": {"reasoning_content": {"thought": 1}}, "reasoning-number": {"reasoning_content": 5},
    "reasoning-list": {"reasoning_content": ["a"]}, "content-number": {"content": 5},
    "choices-empty": {"choices": []}, "choices-null": {"choices": None},
    "usage-strings": {"usage": {"prompt_tokens": "10", "completion_tokens": "3", "total_tokens": "13"}},
    "cut-json": b'{"id": "x", "choices": [{"message": {"content": "ans', "html": b"<html><body>proxy</body></html>",
    "huge": b'{"choices": [{"message": {"content": "' + b"x" * (50 << 20) + b'"}}]}',
}


class HostileServer(FakeServer):
    """Answers /v1/models as a server should and every chat request with the hostile reply `mode` (a key of
    HOSTILE_REPLIES), or `trickle`: a valid reply one byte a second."""

    def __init__(self, mode: str, model: str = "fake") -> None:
        from aiohttp import web

        self.mode, self.model, self.served, self.loop = mode, model, 0, asyncio.new_event_loop()

        async def models(request: web.Request) -> web.Response:
            return web.json_response({"object": "list", "data": [{"id": model, "object": "model"}]})

        async def chat(request: web.Request) -> web.StreamResponse:
            self.served += 1
            good = {"id": "x", "object": "chat.completion", "created": 0, "model": model,
                    "choices": [{"index": 0, "message": {"role": "assistant", "content": "fine"},
                                 "finish_reason": "stop"}], "usage": {"prompt_tokens": 1, "completion_tokens": 1}}
            if mode == "trickle":
                resp = web.StreamResponse(headers={"Content-Type": "application/json"})
                await resp.prepare(request)
                for b in json.dumps(good).encode():
                    await resp.write(bytes([b]))
                    await asyncio.sleep(1.0)
                return resp
            bad = HOSTILE_REPLIES[mode]
            if isinstance(bad, bytes):
                return web.Response(body=bad, content_type="text/html" if mode == "html" else "application/json")
            if "choices" in bad or "usage" in bad:
                return web.json_response({**good, **bad})
            good["choices"][0]["message"].update(bad)
            return web.json_response(good)

        app = web.Application()
        app.router.add_get("/v1/models", models)
        app.router.add_post("/v1/chat/completions", chat)
        self._start(app)


class FaultyProxy(FakeServer):
    """Forwards to `target`, slowly (latency_s), dropping a share of connections before forwarding and a share after
    the server answered (its work is lost)."""

    def __init__(self, target_root: str, seed: int, latency_s: float = 0.1, drop_before: float = 0.05,
                 drop_after: float = 0.02) -> None:
        import aiohttp
        from aiohttp import web

        self.loop = asyncio.new_event_loop()
        self.dropped_before = self.dropped_after = self.forwarded = 0
        rng = random.Random(seed)
        session: list[aiohttp.ClientSession] = []

        async def handle(request: web.Request) -> web.StreamResponse:
            body = await request.read()
            chat = request.path.endswith("/chat/completions")
            await asyncio.sleep(latency_s * rng.random() * 2)
            if chat and rng.random() < drop_before:
                self.dropped_before += 1
                request.transport.abort()  # connection reset, nothing forwarded
                return web.Response(status=500)
            if not session:
                session.append(aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)))
            async with session[0].request(request.method, target_root + request.path_qs, data=body,
                                          headers={"content-type": "application/json"}) as r:
                data = await r.read()
            self.forwarded += chat
            if chat and rng.random() < drop_after:
                self.dropped_after += 1
                request.transport.abort()  # the server did the work; the answer is lost on the way
                return web.Response(status=500)
            return web.Response(body=data, status=r.status, content_type="application/json")

        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", handle)
        self._start(app)


class InChild:
    """Run a FakeServer/FaultyProxy in a forked child process (its own interpreter lock), so that the server, the
    proxy and the load they serve do not share one; `.stats()` returns its counters."""

    def __init__(self, cls: type, *args: Any, **kwargs: Any) -> None:
        import multiprocessing as mp

        ctx = mp.get_context("fork")
        self.conn, child = ctx.Pipe()

        def serve() -> None:
            obj = cls(*args, **kwargs)
            child.send((obj.url, obj.root))
            while True:
                msg = child.recv()
                child.send({k: v for k, v in vars(obj).items() if isinstance(v, int)})
                if msg == "stop":
                    obj.close()
                    return

        self.proc = ctx.Process(target=serve, daemon=True)
        self.proc.start()
        self.url, self.root = self.conn.recv()

    def stats(self) -> dict[str, int]:
        self.conn.send("stats")
        return self.conn.recv()

    def close(self) -> dict[str, int]:
        self.conn.send("stop")
        out = self.conn.recv()
        self.proc.join(30)
        return out


async def _direct_load(url: str, n: int, concurrency: int) -> float:
    """Requests per second the server itself sustains with `concurrency` raw requests in flight."""
    import aiohttp

    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as s:
        queue = list(range(n))
        t0 = time.monotonic()

        async def worker() -> None:
            while queue:
                i = queue.pop()
                body = {"model": "fake", "messages": [{"role": "user", "content": f"direct {i}"}], "max_tokens": 8}
                async with s.post(url + "/chat/completions", json=body) as r:
                    await r.read()

        await asyncio.gather(*(worker() for _ in range(concurrency)))
        return n / (time.monotonic() - t0)


def load_test(c: Campaign) -> None:
    import logging

    logging.getLogger("aiohttp").setLevel(logging.CRITICAL)
    n = 256 if c.short else 2048  # the retry tail at the end weighs less in a longer run
    root = c.out / "load"
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)
    src = root / "source.jsonl"
    src.write_text("".join(json.dumps({"id": f"c{i:05d}", "messages": [
        {"role": "user", "content": f"question {i}"}, {"role": "assistant", "content": "old"}]}) + "\n"
        for i in range(n)))
    server = InChild(FakeServer, slots=16, service_s=0.5)
    proxy = InChild(FaultyProxy, server.root, c.seed, latency_s=0.1)
    try:
        direct = asyncio.run(_direct_load(server.url, n, 64))
        served0 = server.stats()["served"]
        cmd = c.cli("generate", "--data", src, "--endpoint", proxy.url, "--model", "fake", "--out", root / "gen",
                    "--concurrency", "64", "--max-tokens", "8", "--max-retries", "8")
        t0 = time.monotonic()
        r = c.run(cmd)
        wall = time.monotonic() - t0
        m = json.loads((root / "gen" / "manifest.json").read_text()) if (root / "gen" / "manifest.json").is_file() \
            else {}
        ids = [json.loads(ln)["id"] for ln in (root / "gen" / "conversations.jsonl").read_text().splitlines()] \
            if (root / "gen" / "conversations.jsonl").is_file() else []
        this = m.get("this_run", {})
        client = this.get("requests_per_s") or 0.0
        ps = proxy.stats()
        before, after = ps["dropped_before"], ps["dropped_after"]
        # The same run through a proxy without faults: what the client reaches on this machine without any drop.
        clean = InChild(FaultyProxy, server.root, c.seed, latency_s=0.0, drop_before=0.0, drop_after=0.0)
        try:
            r0 = c.run(c.cli("generate", "--data", src, "--endpoint", clean.url, "--model", "fake", "--out",
                             root / "gen-no-faults", "--concurrency", "64", "--max-tokens", "8"))
            m0 = json.loads((root / "gen-no-faults" / "manifest.json").read_text()) if r0.returncode == 0 else {}
            baseline = (m0.get("this_run") or {}).get("requests_per_s") or 0.0
        finally:
            clean.close()
        drops = before + after
        once = len(ids) == len(set(ids)) == n and set(ids) == {f"c{i:05d}" for i in range(n)}
        ok = r.returncode == 0 and once and this.get("retries", -1) >= drops and client >= 0.95 * direct
        c.add(Row("generate (load)", f"{n} conversations, 64 in flight, proxy: 0-0.2 s latency, drops 5% of "
                  "connections before and 2% after the server answered", "every conversation exactly once; "
                  "retries counted; client throughput >= 95% of the server's own",
                  f"exit {r.returncode}; {len(ids)} rows, {len(set(ids))} distinct; {drops} drops "
                  f"({before} before, {after} after), {this.get('retries')} retries "
                  f"counted; client {client:.1f} req/s vs server's own {direct:.1f} req/s "
                  f"({client / direct:.1%}; without faults the client reaches {baseline / direct:.1%})", ok,
                  n - len(set(ids)), command_text(cmd), wall,
                  {"server_direct_req_s": round(direct, 2), "client_req_s": client, "ratio": round(client / direct, 4),
                   "client_no_faults_req_s": baseline, "drops_before": before, "drops_after": after,
                   "retries": this.get("retries"), "server_requests": server.stats()["served"] - served0}))
    finally:
        proxy.close()
        server.close()


# --- generate kill -9 against a real server ------------------------------------------------------------------
@contextlib.contextmanager
def chat_server(c: Campaign) -> Iterator[tuple[str, str, str]]:
    """(base_url, model, kind): a real vLLM CPU server for SmolLM2 when available, else the local fake server."""
    from eagle3_train.serving.vllm_server import VLLMServer, vllm_available

    ok, msg = vllm_available()
    if ok and not os.environ.get("EAGLE3_CAMPAIGN_NO_VLLM"):
        from eagle3_train.assets.verifier import resolve_verifier

        server = VLLMServer(resolve_verifier("smollm2-135m-instruct"), served_model_name="smollm2",
                            enforce_eager=True, max_model_len=2048, log_path=c.out / "vllm.log")
        with server:
            yield server.base_url, "smollm2", f"vLLM CPU server (SmolLM2, started in {server.startup_s:.0f} s)"
        return
    fake = FakeServer(slots=1, service_s=0.3)
    try:
        yield fake.url, "fake", f"local OpenAI-compatible server (vLLM unavailable: {msg[:80]})"
    finally:
        fake.close()


def kill_generate(c: Campaign, a: Assets) -> None:
    src = conversations_file(c.out / "assets" / "gen-source.jsonl", 6 if c.short else 16)
    with chat_server(c) as (url, model, kind):
        out = c.out / "kill" / "generate"

        def compare(ref: Path, got: Path) -> list[str]:
            def rows(p: Path) -> dict[str, Any]:
                f = p / "conversations.jsonl"
                return {r["id"]: r for r in map(json.loads, f.read_text().splitlines())} if f.is_file() else {}

            rr, gr = rows(ref), rows(got)
            lines = (got / "conversations.jsonl").read_text().splitlines() if rr else []
            dup = len(lines) - len(gr)
            diffs = [f"{k}: missing" for k in rr if k not in gr]
            diffs += [f"{k}: differs" for k in rr if k in gr and rr[k]["messages"] != gr[k]["messages"]]
            return diffs + ([f"{dup} duplicate rows"] if dup else [])

        def state(p: Path) -> str:
            f = p / "conversations.jsonl"
            n = f.read_bytes().count(b"\n") if f.is_file() else 0
            return f"{n} rows written"

        cmd = c.cli("generate", "--data", src, "--endpoint", url, "--model", model, "--out", out,
                    "--concurrency", "1", "--max-tokens", "32", "--temperature", "0")
        n0 = len(c.rows)
        kill_stage(c, "generate", cmd, out, lines("conversations.jsonl"), compare, state)
        for r in c.rows[n0:]:
            r.details["server"] = kind
        errors_against_servers(c, src, url, model)


def errors_against_servers(c: Campaign, src: Path, url: str, model: str) -> None:
    """An unreachable and a 500-ing server, during generate and evaluate served."""
    prompts = c.out / "assets" / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"id": f"p{i}", "turns": [f"Say {i}."]}) + "\n" for i in range(3)))
    dead = "http://127.0.0.1:9/v1"
    failing = FakeServer(mode="500")
    try:
        for name, endpoint, mdl in (("unreachable server", dead, "fake"), ("server answering 500", failing.url,
                                                                           "fake")):
            out = c.out / "inputs" / f"gen-{name.split()[0]}"
            shutil.rmtree(out, ignore_errors=True)
            cmd = c.cli("generate", "--data", src, "--endpoint", endpoint, "--model", mdl, "--out", out,
                        "--max-retries", "2", "--max-tokens", "8")
            t0 = time.monotonic()
            r = c.run(cmd, timeout=600)
            ok, text = clean_error(r, endpoint.rsplit("/v1", 1)[0])
            c.add(Row("generate", name, "exit 2 naming the endpoint; rerun resumes", text, ok, 0, command_text(cmd),
                      time.monotonic() - t0))
            out = c.out / "inputs" / f"eval-{name.split()[0]}"
            shutil.rmtree(out, ignore_errors=True)
            cmd = c.cli("evaluate", "served", "--endpoint", endpoint, "--model", mdl, "--prompts", prompts,
                        "--turns", "1", "--max-tokens", "8", "--out", out)
            t0 = time.monotonic()
            r = c.run(cmd, timeout=900)
            ok, text = clean_error(r, endpoint.rsplit("/v1", 1)[0])
            c.add(Row("evaluate served", name, "exit 2 naming the endpoint", text, ok, 0, command_text(cmd),
                      time.monotonic() - t0))
    finally:
        failing.close()
    del url, model


# --- bad inputs -----------------------------------------------------------------------------------------------
@contextlib.contextmanager
def small_fs(path: Path, size: int, read_only: bool = False) -> Iterator[bool]:
    """Mount a tmpfs of `size` bytes at `path` (True), or yield False where mounting is not permitted."""
    path.mkdir(parents=True, exist_ok=True)
    opts = f"size={size}" + (",ro" if read_only else "")
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", opts, "tmpfs", str(path)], capture_output=True)
    if r.returncode != 0:
        yield False
        return
    try:
        yield True
    finally:
        subprocess.run(["umount", "-l", str(path)], capture_output=True)


def fill_when(path: Path, trigger: Callable[[], bool], stop: threading.Event) -> threading.Thread:
    """Fill the filesystem of `path` (a filler file) as soon as `trigger()` is true: a disk that runs full."""
    def work() -> None:
        while not stop.is_set():
            if trigger():
                with open(path / "filler", "wb") as f:
                    with contextlib.suppress(OSError):
                        while True:
                            f.write(b"\0" * (1 << 16))
                            f.flush()
                return
            time.sleep(0.02)

    t = threading.Thread(target=work, daemon=True)
    t.start()
    return t


def available_memory() -> int:
    with contextlib.suppress(OSError, ValueError, IndexError):
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return 0


def fsize_limit(n: int) -> Callable[[], None]:
    def set_limit() -> None:
        resource.setrlimit(resource.RLIMIT_FSIZE, (n, n))
    return set_limit


def prepare_row(c: Campaign, a: Assets, fault: str, data: Path, expected: str, must: tuple[str, ...] = (),
                skip: dict[str, int] | None = None, extra: tuple[str, ...] = (), verifier: Path | None = None,
                counts_key: str = "bad_records") -> None:
    """One bad source: without --skip-bad-records a clear error naming `must`; with it (or for turn-level problems)
    a counted skip equal to `skip` in manifest counts[counts_key]."""
    if not c.wanted(fault):
        return
    out = c.out / "inputs" / ("prep-" + hashlib.sha1(fault.encode()).hexdigest()[:8])
    shutil.rmtree(out, ignore_errors=True)
    cmd = c.cli("prepare", "--data", data, "--verifier", verifier or a.verifier, "--out", out, "--max-length", "160",
                "--val-count", "1", *extra)
    t0 = time.monotonic()
    r = c.run(cmd)
    if must:
        ok, text = clean_error(r, *must)
        c.add(Row("prepare", fault, expected, text, ok, 0, command_text(cmd), time.monotonic() - t0))
    if skip is not None:
        cmd2 = cmd + ["--skip-bad-records"] if must else cmd
        if must:
            shutil.rmtree(out, ignore_errors=True)
            r = c.run(cmd2)
        got = {}
        if r.returncode == 0:
            m = json.loads((out / "manifest.json").read_text())
            got = m["counts"].get(counts_key, {})
        ok = r.returncode == 0 and got == skip
        handled = (f"skipped and counted: {counts_key} {got}" if r.returncode == 0
                   else f"exit {r.returncode}: {error_excerpt(r)}")
        c.add(Row("prepare", fault + (" (--skip-bad-records)" if must else ""), f"counted skip {skip}", handled, ok,
                  0, command_text(cmd2), time.monotonic() - t0))


def big_line(c: Campaign, a: Assets, source: Callable[[str, list[bytes]], Path], good: list[bytes]) -> None:
    """A single huge record: prepare must truncate/skip and count it (or refuse it clearly), not fall over."""
    d = c.out / "inputs"
    big_mb = 10 if c.short else 100
    avail = available_memory()
    if big_mb == 100 and avail < 16 * 2**30:  # tokenizing the whole line takes several GB: spare a shared machine
        big_mb = 25
    if not c.wanted(f"a {big_mb} MB line"):
        return
    big = json.dumps({"id": "huge", "messages": [{"role": "user", "content": "word " * (big_mb * 2**20 // 5)},
                                                 {"role": "assistant", "content": "ok"}]}).encode()
    t0 = time.monotonic()
    out = d / "prep-big"
    shutil.rmtree(out, ignore_errors=True)
    cmd = c.cli("prepare", "--data", source("big-line.jsonl", good[:4] + [big]), "--verifier", a.verifier, "--out",
                out, "--max-length", "160", "--val-count", "1")
    del big
    r = c.run(cmd)
    peak = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 2**20
    if r.returncode == 0:
        m = json.loads((out / "manifest.json").read_text())["counts"]
        handled = (f"exit 0; truncated {m['truncated']}, skipped {m['skipped']}; largest child RSS so far "
                   f"{peak:.1f} GB")
        ok = m["truncated"] + m["skipped_total"] >= 1
    else:
        ok, handled = clean_error(r, "big-line.jsonl")
    c.add(Row("prepare", f"a {big_mb} MB line", "truncated/skipped and counted, or exit 2 naming it", handled, ok,
              0, command_text(cmd), time.monotonic() - t0))


def inputs(c: Campaign, a: Assets) -> None:
    d = c.out / "inputs"
    d.mkdir(parents=True, exist_ok=True)
    for old in [*d.glob("t-*"), *d.glob("x-*"), *d.glob("prep-*")]:  # outputs of an earlier campaign: start afresh
        shutil.rmtree(old, ignore_errors=True)
    good = a.source.read_bytes().splitlines()

    def source(name: str, lines: list[bytes]) -> Path:
        p = d / name
        p.write_bytes(b"\n".join(lines) + b"\n")
        return p

    # --- sources ---
    prepare_row(c, a, "malformed JSON line", source("bad-json.jsonl", good[:3] + [b'{"id": "x", "messages": [}']
                                                    + good[3:6]),
                "exit 2 naming file and line; counted skip with --skip-bad-records", ("bad-json.jsonl", "line 4"),
                {"invalid_json": 1})
    prepare_row(c, a, "invalid UTF-8", source("bad-utf8.jsonl", good[:3] + [good[3].replace(b'"}', b'\xff\xfe"}', 1)]
                                               + good[4:6]),
                "exit 2 naming file and line; counted skip with --skip-bad-records", ("bad-utf8.jsonl", "line 4"),
                {"invalid_utf8": 1})
    big_line(c, a, source, good)
    unknown = json.dumps({"id": "r", "conversations": [{"from": "robot", "value": "beep"},
                                                       {"from": "gpt", "value": "x"}]}).encode()
    prepare_row(c, a, "unknown role", source("role.jsonl", good[:3] + [unknown] + good[3:6]),
                "exit 2 naming file, line and field; counted skip with --skip-bad-records",
                ("role.jsonl", "line 4", "'from'", "robot"), {"invalid_record": 1})
    empty = json.dumps({"id": "e", "messages": [{"role": "user", "content": "  "},
                                                {"role": "assistant", "content": "x"}]}).encode()
    prepare_row(c, a, "empty turn", source("empty.jsonl", good[:3] + [empty] + good[3:6]), "counted skip",
                skip={"empty_turn": 1}, counts_key="skipped")
    raising = d / "raising.jinja"
    raising.write_text("{% for m in messages %}{% if m['content'] == 'boom' %}{{ raise_exception('template says "
                       "no') }}{% endif %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                       "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    boom = json.dumps({"id": "b", "messages": [{"role": "user", "content": "boom"},
                                               {"role": "assistant", "content": "x"}]}).encode()
    prepare_row(c, a, "chat template that raises (on one conversation)", source("boom.jsonl", good[:4] + [boom]),
                "counted skip", skip={"chat_template_error": 1}, extra=("--chat-template", raising),
                counts_key="skipped")
    always = d / "always.jinja"
    always.write_text("{{ raise_exception('this template refuses everything') }}")
    prepare_row(c, a, "chat template that always raises", a.source, "exit 2 naming the template's message",
                ("refuses everything",), extra=("--chat-template", always))
    no_tmpl = tiny_llama(c.out / "assets" / "tiny-no-template", drop_template=True)
    prepare_row(c, a, "tokenizer without a chat template", a.source, "exit 2 naming the verifier/tokenizer",
                ("chat template",), verifier=no_tmpl)

    # --- mismatched stage outputs ---
    other = tiny_llama(c.out / "assets" / "tiny-other-tokenizer", seed=1, vocab_extra=64, add_token=True)
    other_prep = d / "prepared-other"
    if not (other_prep / "manifest.json").is_file() and (c.wanted("another verifier") or c.wanted("another tok")):
        c.run(c.cli("prepare", "--data", a.source, "--verifier", other, "--out", other_prep, "--max-length", "160",
                    "--val-count", "3"))
    other_vocab = d / "vocab-other"
    if not (other_vocab / "vocab.safetensors").is_file() and c.wanted("another tokenizer"):
        c.run(c.cli("vocab", "--prepared", other_prep, "--out", other_vocab, "--size", "1024"))

    def row(stage: str, fault: str, cmd: list[str], expected: str, must: tuple[str, ...],
            preexec: Callable[[], None] | None = None) -> None:
        if not c.wanted(fault):
            return
        t0 = time.monotonic()
        r = c.run(cmd, preexec=preexec)
        ok, text = clean_error(r, *must)
        c.add(Row(stage, fault, expected, text, ok, 0, command_text(cmd), time.monotonic() - t0))

    row("extract", "prepared data from another verifier (other tokenizer)",
        c.cli("extract", "--prepared", other_prep, "--verifier", a.verifier, "--out", d / "x-other", "--dtype",
              "float32"), "exit 2 naming the prepared data and the verifier", ("prepared",))
    prep2 = d / "prepared-2"
    if not (prep2 / "manifest.json").is_file() and c.wanted("other data"):
        c.run(c.cli("prepare", "--data", conversations_file(d / "other-convs.jsonl", 24, offset=24), "--verifier",
                    a.verifier, "--out", prep2, "--max-length", "160", "--val-count", "3"))
    cmd = train_cmd(c, a, d / "t-other-data")
    cmd[cmd.index("--prepared") + 1] = str(prep2)
    row("train", "hidden states from other data", cmd, "exit 2 naming the hidden states and the prepared data",
        ("hidden",))
    cmd = train_cmd(c, a, d / "t-other-vocab")
    cmd[cmd.index("--vocab") + 1] = str(other_vocab)
    row("train", "a vocab from another tokenizer", cmd, "exit 2 naming the vocab", ("vocab",))
    src_draft = write_foreign_draft(d / "foreign-draft")
    row("train", "a finetune source for another verifier (SmolLM2 shapes)",
        train_cmd(c, a, d / "t-finetune", extra=("--finetune-from", str(src_draft))),
        "exit 2 naming the source and the mismatch", ("foreign-draft",))

    # --- damaged shards ---
    for fault, damage, must in (("a truncated shard", truncate_shard, ("shard-00001",)),
                                ("NaN/Inf in a shard", nan_shard, ("shard-00001",))):
        h = d / ("hidden-" + damage.__name__)
        shutil.rmtree(h, ignore_errors=True)
        shutil.copytree(a.hidden, h)
        damage(h / "train" / "shard-00001.safetensors")
        cmd = train_cmd(c, a, d / ("t-" + damage.__name__), hidden=h)
        row("train", fault, cmd, "exit 2 naming the shard and how to re-extract it", must)

    # --- the file system ---
    ro = d / "readonly"
    with small_fs(ro, 4 << 30, read_only=True) as mounted:  # roomy: the space checks must not hide the write
        if not mounted:
            ro.mkdir(exist_ok=True)
            ro.chmod(0o555)
        for stage, cmd in (("prepare", c.cli("prepare", "--data", a.source, "--verifier", a.verifier, "--out",
                                               ro / "prepared", "--max-length", "160")),
                           ("extract", extract_cmd(c, a, ro / "hidden")),
                           ("train", train_cmd(c, a, ro / "train"))):
            row(stage, "a read-only output directory" + ("" if mounted else " (chmod 555; root ignores it)"), cmd,
                "exit 2 naming the directory", (str(ro),))
        if not mounted:
            ro.chmod(0o755)
    disk_full(c, a, row)


def disk_full(c: Campaign, a: Assets, row: Callable[..., Any]) -> None:
    """A disk that runs full during extract and during a checkpoint write; after freeing space the rerun resumes and
    ends identical to an uninterrupted run."""
    d = c.out / "inputs"
    if c.wanted("full disk during convert-verifier"):
        with small_fs(d / "full-convert", 2 << 20) as mounted:  # the tiny verifier's weights need ~13 MB
            cmd = c.cli("convert-verifier", a.verifier, "--out", d / "full-convert" / "verifier")
            r = subprocess.run(cmd, capture_output=True, text=True, env=c.env, errors="replace",
                               preexec_fn=None if mounted else fsize_limit(200_000))
            ok, text = clean_error(r, "space" if mounted else "large")
            left = [p.name for p in (d / "full-convert").iterdir() if p.name != "filler"]
            c.add(Row("convert-verifier", "full disk during convert-verifier --out", "exit 2 naming the space; no "
                      "half-written directory left", text + (f"; left: {left}" if left else ""), ok and not left, 0,
                      command_text(cmd)))
    if not any(c.wanted(f"full disk during {s}") for s in ("extract", "train")):
        return
    ref_extract = d / "full-ref-extract"
    if not (ref_extract / "manifest.json").is_file():
        c.run(extract_cmd(c, a, ref_extract))
    ref_train = d / "full-ref-train"
    if not (ref_train / "final").is_dir():
        c.run(train_cmd(c, a, ref_train))
    env = {**c.env, "EAGLE3_TRAIN_DISK_MARGIN_BYTES": "0"}
    for stage, size, ref, make_cmd, trigger, compare in (
            ("extract", 64 << 20, ref_extract, lambda o: extract_cmd(c, a, o),
             lambda o: len(list(o.glob("train/shard-*.safetensors"))) >= 2, compare_extract),
            ("train (checkpoint write)", 64 << 20, ref_train, lambda o: train_cmd(c, a, o),
             lambda o: len(list((o / "checkpoints").glob("step-*"))) >= 1, compare_train)):
        mnt = d / f"full-{stage.split()[0]}"
        if not c.wanted(f"full disk during {stage}"):
            continue
        t0 = time.monotonic()
        with small_fs(mnt, size) as mounted:
            out = mnt / "out"
            cmd = make_cmd(out)
            if mounted:
                stop = threading.Event()
                filler = fill_when(mnt, lambda out=out, trigger=trigger: trigger(out), stop)
                r = subprocess.run(cmd, capture_output=True, text=True, env=env, errors="replace")
                stop.set()
                filler.join(10)
                how = "tmpfs that a filler file runs full"
            else:  # no mount permission: a per-file size limit (EFBIG) instead
                (mnt / "out").mkdir(exist_ok=True)
                r = subprocess.run(cmd, capture_output=True, text=True, env=env, errors="replace",
                                   preexec_fn=fsize_limit(200_000))
                how = "RLIMIT_FSIZE 200 kB"
            ok, text = clean_error(r, "space" if mounted else "large")
            (mnt / "filler").unlink(missing_ok=True)
            r2 = subprocess.run(cmd, capture_output=True, text=True, env=env, errors="replace")
            diffs = compare(ref, out) if r2.returncode == 0 else ["<rerun failed>"]
            extra = leftovers(ref, out)
            handled = (f"{text}; after freeing space the rerun exits {r2.returncode}"
                       + (f", differs: {diffs[:4]}" if diffs else ", outputs identical to an uninterrupted run")
                       + (f"; left behind: {extra[:4]}" if extra else ""))
            c.add(Row(stage.split()[0], f"full disk during {stage} ({how})", "exit 2 naming the file/space; rerun "
                      "after freeing space resumes, outputs identical", handled, ok and not diffs and not extra,
                      len(diffs), command_text(cmd) + f"  # on a {how}", time.monotonic() - t0))
    del row


def truncate_shard(path: Path) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


def nan_shard(path: Path) -> None:
    """NaN and Inf written into a shard, with its index entry updated to match (as if extract had stored them)."""
    import torch
    from safetensors import safe_open
    from safetensors.torch import save_file

    with safe_open(str(path), "pt") as f:
        meta = f.metadata()
        t = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 - safe_open has no __iter__
    t["aux"][3, :5] = float("nan")
    t["final"][7, 0] = float("inf")
    save_file(t, str(path), metadata=meta)
    index_path = path.parent / "index.json"
    index = json.loads(index_path.read_text())
    for e in index["shards"]:
        if e["file"] == path.name:
            e["sha256"] = hashlib.sha256(path.read_bytes()).hexdigest()
            e["bytes"] = path.stat().st_size
    index_path.write_text(json.dumps(index, indent=2))
    del torch


# --- what the tool must never delete or overwrite ---------------------------------------------------------------
def _user_files(root: Path) -> dict[str, str]:
    """Relative path -> SHA-256 of every file under `root` (the user's files a row must leave as they were)."""
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file() and not p.is_symlink()}


def _foreign(d: Path, *names: str) -> Path:
    """A directory of the user's files, named like ours where it matters (manifest.json, index.json, shards)."""
    shutil.rmtree(d, ignore_errors=True)
    for name in ("notes.txt", *names):
        (d / name).parent.mkdir(parents=True, exist_ok=True)
        (d / name).write_text(f"the user's {name}\n")
    return d


class HostileEndpoint:
    """An OpenAI-compatible stub that names `victim` as its hidden-state file (stdlib HTTP server, own thread)."""

    def __init__(self, victim: str) -> None:
        from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

        class Handler(BaseHTTPRequestHandler):
            def _send(self, body: dict) -> None:
                data = json.dumps(body).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self):  # noqa: N802
                self._send({"object": "list", "data": [{"id": "stub", "object": "model", "created": 0,
                                                        "owned_by": "x"}]} if self.path.endswith("/models")
                           else {"version": "stub"})

            def do_POST(self):  # noqa: N802
                ids = json.loads(self.rfile.read(int(self.headers["Content-Length"])))["prompt"]
                self._send({"id": "c", "object": "text_completion", "created": 0, "model": "stub",
                            "choices": [{"index": 0, "text": "x", "finish_reason": "length", "logprobs": None,
                                         "prompt_token_ids": ids}],
                            "kv_transfer_params": {"hidden_states_path": victim}})

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.handle_error = lambda *args: None  # the client hangs up once it refuses the answer
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        self.url = f"http://127.0.0.1:{self.server.server_port}/v1"

    def close(self) -> None:
        self.server.shutdown()


def ownership(c: Campaign, a: Assets) -> None:
    d = c.out / "ownership"
    shutil.rmtree(d, ignore_errors=True)
    d.mkdir(parents=True)
    run_dir = d / "run"
    c.run(train_cmd(c, a, run_dir, extra=("--max-steps", "2")))
    export = ("--format", "eagle")

    def row(fault: str, cmd: list[str], user: Path, expected: str, must: tuple[str, ...] = (), code: int = 2,
            check: Callable[[], str] | None = None) -> None:
        """Run `cmd`; ok when it ends with `code` (2: a clean error naming `must`) and every file under `user`
        is as it was (`lost` counts those missing or changed); `check` adds a condition (its text: what failed)."""
        if not c.wanted(fault):
            return
        before = _user_files(user)
        t0 = time.monotonic()
        r = c.run(cmd)
        after = _user_files(user)
        lost = sum(1 for k, v in before.items() if after.get(k) != v)
        ok, text = clean_error(r, *must) if code == 2 else (r.returncode == code, f"exit {r.returncode}")
        problem = check() if check else ""
        c.add(Row("ownership", fault, expected, (text + (f"; {problem}" if problem else ""))[:300],
                  ok and not lost and not problem, lost, command_text(cmd), time.monotonic() - t0))

    never = "exit 2 naming the directory; the user's files untouched"
    foreign = _foreign(d / "user-hs", "manifest.json", "train/index.json", "train/shard-00000.safetensors")
    row("extract --overwrite into a foreign directory", [*extract_cmd(c, a, foreign), "--overwrite"], foreign, never,
        (str(foreign), "even with --overwrite"))
    user = _foreign(d / "userB", ".draft.old/keep.txt", ".draft.eagle3-tmp-x/keep.txt", ".prep.cache/keep.txt")
    row("export beside the user's .draft.old/ (and a look-alike of our temp name)",
        c.cli("export", run_dir, "--out", user / "draft", *export), user, "exit 0; the siblings kept", code=0)
    row("prepare beside the user's .prep.cache/",
        c.cli("prepare", "--data", a.source, "--verifier", a.verifier, "--out", user / "prep", "--max-length", "160",
              "--val-count", "3"), user, "exit 0; the siblings kept", code=0)
    row("prepare again with other settings, no --overwrite",
        c.cli("prepare", "--data", a.source, "--verifier", a.verifier, "--out", user / "prep", "--max-length", "128",
              "--val-count", "3"), user, "exit 2 naming the changed setting", ("max_length", "--overwrite"))
    data = user / "prep" / "mine.jsonl"
    shutil.copy(a.source, data)
    row("prepare --data inside --out (the user's only copy)",
        c.cli("prepare", "--data", data, "--verifier", a.verifier, "--out", user / "prep", "--overwrite"), user,
        "exit 2; the data kept", ("lies inside --out",))
    fake_run = _foreign(d / "user-run", "checkpoints/step-0/weights.pt", "metrics.jsonl")
    row("train --resume into a directory holding checkpoints/ and metrics.jsonl",
        train_cmd(c, a, fake_run), fake_run, never, (str(fake_run),))
    results = _foreign(d / "user-eval", "results.json", "config.json", "tokenizer.json")
    row("evaluate offline --out over the user's results.json",
        c.cli("evaluate", "offline", "--draft", run_dir, "--verifier", a.verifier, "--out", results,
              "--num-prompts", "1"), results, never, (str(results),))
    row("convert-verifier --out over the user's config.json",
        c.cli("convert-verifier", a.verifier, "--out", results), results, never, (str(results),))
    real = d / "disk" / "draft"
    real.parent.mkdir(parents=True, exist_ok=True)
    link = d / "draft-link"
    link.symlink_to(real, target_is_directory=True)
    row("export --out through a symlink", c.cli("export", run_dir, "--out", link, *export), d / "disk",
        "exit 0; the link kept, the export in its target", code=0,
        check=lambda: "" if link.is_symlink() and (real / "model.safetensors").is_file()
        and not list(d.glob(".draft-link*")) else "the link was replaced or a hidden leftover stayed")
    pointer = run_dir / "checkpoints" / "latest.json"
    kept = pointer.read_text()
    pointer.write_text(json.dumps({"dir": "step-0000099"}))
    row("train --resume with latest.json naming a missing checkpoint",
        train_cmd(c, a, run_dir, extra=("--max-steps", "3")), run_dir / "checkpoints", "exit 2; nothing overwritten",
        ("step-0000099",))
    pointer.write_text(kept)
    victim_dir = _foreign(d / "victim", "precious.safetensors")
    hs_dir = d / "hs-tmp"
    hs_dir.mkdir()
    for case, named in (("outside the directory", victim_dir / "precious.safetensors"),
                        ("through ..", hs_dir / ".." / "victim" / "precious.safetensors")):
        endpoint = HostileEndpoint(str(named))
        try:
            row(f"extract --backend vllm: the endpoint names a file {case}",
                c.cli("extract", "--backend", "vllm", "--endpoint", endpoint.url, "--prepared", a.prepared,
                      "--verifier", a.verifier, "--out", d / f"hs-{case[:7].strip()}", "--hidden-states-dir", hs_dir),
                victim_dir, "exit 2; the file neither read nor deleted", ("refusing to read or delete",))
        finally:
            endpoint.close()
    ownership_by_file_list(c, a, d, run_dir, hs_dir, row)
    good = a.source.read_bytes().splitlines()
    cut = d / "cut.jsonl"
    cut.write_bytes(b"\n".join([good[0], good[1][: len(good[1]) // 2].rsplit(b",", 1)[0] + b",", *good[2:6]]) + b"\n")
    out = d / "prep-cut"
    row("--skip-bad-records after a line cut between tokens",
        c.cli("prepare", "--data", cut, "--verifier", a.verifier, "--out", out, "--val-count", "1",
              "--skip-bad-records"), d / "victim", "exit 0; one bad record counted, the next one kept", code=0,
        check=lambda: "" if (out / "manifest.json").is_file() and json.loads((out / "manifest.json").read_text())[
            "counts"]["bad_records"] == {"invalid_json": 1} and json.loads((out / "manifest.json").read_text())[
            "counts"]["conversations_read"] == 5 else "the wrong records were skipped")


def _copy_without_dot_files(src: Path, dst: Path) -> Path:
    """What `cp -r out/* copy/` makes of an output (our marker is a dot file), plus the user's NOTES.txt."""
    shutil.rmtree(dst, ignore_errors=True)
    dst.mkdir(parents=True)
    for entry in src.iterdir():
        if not entry.name.startswith("."):
            (shutil.copytree if entry.is_dir() else shutil.copy2)(entry, dst / entry.name)
    (dst / "NOTES.txt").write_text("the user's own notes\n")
    return dst


def _poisoned_copy(src: Path, dst: Path) -> Path:
    """A copy of checkpoint `src` with one NaN in its fc weight."""
    from safetensors.torch import load_file, save_file

    shutil.rmtree(dst, ignore_errors=True)
    shutil.copytree(src, dst)
    tensors = load_file(str(dst / "model.safetensors"))
    tensors["fc.weight"].view(-1)[7] = float("nan")
    save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst


def ownership_by_file_list(c: Campaign, a: Assets, d: Path, run_dir: Path, hs_dir: Path, row: Callable) -> None:
    """Issue 38's classes: a directory is ours only for the files its marker lists; paths read from files we did not
    write stay inside their directory; a NaN never becomes a draft."""
    export = d / "exp"
    c.run(c.cli("export", run_dir, "--out", export, "--format", "eagle"))
    converted = d / "converted"
    c.run(c.cli("convert-verifier", a.verifier, "--out", converted))
    evaluated = d / "evaluated"
    c.run(c.cli("evaluate", "offline", "--draft", run_dir, "--verifier", a.verifier, "--num-prompts", "1",
                "--out", evaluated))
    generated, server = d / "generated", FakeServer(service_s=0.0)
    try:
        gen = lambda o: c.cli("generate", "--data", a.source, "--endpoint", server.url, "--model", "fake",  # noqa: E731
                              "--out", o, "--limit", "3", "--overwrite")
        c.run(gen(generated))
        _own_copies(c, a, d, run_dir, row, converted, evaluated, export, generated, gen)
    finally:
        server.close()
    for what, marker in (("no file list (an older version's)", {"tool": "eagle3-train", "stage": "export"}),
                         ("an empty file list (a failed run's)", {"tool": "eagle3-train", "stage": "export",
                                                                   "files": []})):
        bare = d / f"bare-{len(marker)}"
        shutil.rmtree(bare, ignore_errors=True)
        bare.mkdir()
        (bare / ".eagle3-train.json").write_text(json.dumps(marker))
        (bare / "serve.sh").write_text("vllm serve ...\n")
        row(f"export --overwrite into a directory whose marker has {what}, holding the user's serve.sh",
            c.cli("export", run_dir, "--out", bare, "--format", "eagle", "--overwrite"), bare,
            "exit 2; serve.sh kept", (str(bare),))
    hs = d / "hs-own"
    if not (hs / "manifest.json").is_file():
        c.run(extract_cmd(c, a, hs))
    backup = hs / "train.bak"
    if not backup.is_dir():
        shutil.copytree(hs / "train", backup)
    row("extract --overwrite beside the user's train.bak/ of shards", [*extract_cmd(c, a, hs), "--overwrite"],
        backup, "exit 0; train.bak/ untouched", code=0)
    import torch
    from safetensors.torch import save_file

    mine = hs_dir / "notes.safetensors"
    save_file({"x": torch.zeros(2)}, str(mine))
    endpoint = HostileEndpoint(str(mine))
    try:
        row("extract --backend vllm: the endpoint names the user's safetensors file inside --hidden-states-dir",
            c.cli("extract", "--backend", "vllm", "--endpoint", endpoint.url, "--prepared", a.prepared,
                  "--verifier", a.verifier, "--out", d / "hs-named", "--hidden-states-dir", hs_dir), hs_dir,
            "exit 2; the file kept", ("lacks hidden_states",))
    finally:
        endpoint.close()
    evil = d / "escaping-index"
    shutil.rmtree(evil, ignore_errors=True)
    shutil.copytree(run_dir / "final", evil)
    names = list(json.loads((evil / "model.safetensors").read_bytes()[8:8 + int.from_bytes(
        (evil / "model.safetensors").read_bytes()[:8], "little")]))
    (evil / "model.safetensors").rename(d / "outside.safetensors")
    (evil / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {k: "../outside.safetensors" for k in names if k != "__metadata__"}}))
    row("inspect a draft whose index names ../outside.safetensors", c.cli("inspect", evil), d,
        "exit 2; the file outside not read", ("refusing to read it",))
    row("finetune from a draft whose index names ../outside.safetensors",
        train_cmd(c, a, d / "t-escaping", extra=("--finetune-from", str(evil))), d,
        "exit 2; the file outside not read", ("refusing to read it",))
    nan = _poisoned_copy(run_dir / "final", d / "nan-source")
    row("finetune from a source holding one NaN", train_cmd(c, a, d / "t-nan", extra=("--finetune-from", str(nan))),
        nan, "exit 2 naming the tensor", ("'fc.weight' holds 1 NaN/inf",))
    row("export a checkpoint holding one NaN", c.cli("export", nan, "--out", d / "nan-export", "--format", "eagle"),
        nan, "exit 2 naming the tensor", ("'fc.weight' holds 1 NaN/inf",))
    row("evaluate offline a checkpoint holding one NaN",
        c.cli("evaluate", "offline", "--draft", nan, "--verifier", a.verifier, "--num-prompts", "1"), nan,
        "exit 2 naming the tensor", ("'fc.weight' holds 1 NaN/inf",))


def _without(cmd: list[str], flag: str) -> list[str]:
    i = cmd.index(flag)
    return cmd[:i] + cmd[i + 2:]


def _own_copies(c: Campaign, a: Assets, d: Path, run_dir: Path, row: Callable, converted: Path, evaluated: Path,
                export: Path, generated: Path, gen: Callable) -> None:
    adopt = ("eagle3-train adopt",)
    for stage, src, cmd, must in (
            ("export", export, lambda o: c.cli("export", run_dir, "--out", o, "--format", "eagle", "--overwrite"),
             adopt),
            ("prepare", d.parent / "ownership" / "userB" / "prep",
             lambda o: c.cli("prepare", "--data", a.source, "--verifier", a.verifier, "--out", o, "--max-length", "128",
                             "--val-count", "3", "--overwrite"), adopt),
            ("convert-verifier", converted, lambda o: c.cli("convert-verifier", a.verifier, "--out", o), ()),
            ("extract", a.hidden, lambda o: [*extract_cmd(c, a, o), "--overwrite"], adopt),
            ("train", run_dir, lambda o: [*train_cmd(c, a, o), "--overwrite"], adopt),
            ("vocab", a.vocab, lambda o: c.cli("vocab", "--prepared", a.prepared, "--out", o, "--size", "512",
                                                "--overwrite"), adopt),
            ("evaluate", evaluated, lambda o: c.cli("evaluate", "offline", "--draft", run_dir, "--verifier",
                                                     a.verifier, "--num-prompts", "1", "--out", o), adopt),
            ("generate", generated, gen, adopt)):
        if src.is_dir():
            copy = _copy_without_dot_files(src, d / f"copy-{stage}")
            row(f"{stage} into a copy made without its dot files (cp -r out/* copy/) plus the user's NOTES.txt",
                cmd(copy), copy, "exit 2 (naming `eagle3-train adopt` where recognisable); every file kept",
                (str(copy), *must))


def replies(c: Campaign, a: Assets) -> None:
    """generate against endpoints whose replies are malformed, oversized or trickled: a clean stop naming the
    reasons (past MALFORMED_STOP skips), never a traceback, a repr in the data, or a hang."""
    d = c.out / "replies"
    shutil.rmtree(d, ignore_errors=True)
    d.mkdir(parents=True)
    for mode in [*HOSTILE_REPLIES, "trickle"]:
        fault = f"generate against an endpoint replying {mode}"
        if not c.wanted(fault):
            continue
        server = HostileServer(mode)
        out = d / mode
        cmd = c.cli("generate", "--data", a.source, "--endpoint", server.url, "--model", "fake", "--out", out,
                    "--limit", "12", "--max-tokens", "8", "--max-retries", "0", "--concurrency", "2",
                    "--timeout", "3")
        t0 = time.monotonic()
        try:
            r = c.run(cmd, timeout=120)
        finally:
            server.close()
        want = ("no complete reply within 3 s",) if mode == "trickle" else ("not OpenAI chat completions",)
        ok, text = clean_error(r, *want)
        rows = (out / "conversations.jsonl").read_text().strip() if (out / "conversations.jsonl").is_file() else ""
        c.add(Row("generate (replies)", fault, "exit 2 naming the reason; nothing stored from the bad replies",
                  text, ok and not rows, 0, command_text(cmd), time.monotonic() - t0))
    bad = d / "bad-lr.yaml"
    bad.write_text(json.dumps({"run_dir": str(d / "run"), "verifier": str(a.verifier),
                               "prepare": {"data": str(a.source)}, "train": {"lr": float("inf")}}).replace(
        "Infinity", ".inf"))
    for fault, cmd in (("train --lr inf", train_cmd(c, a, d / "t-inf", extra=("--lr", "inf"))),
                       ("train --set train.lr=.inf", _without(train_cmd(c, a, d / "t-inf", extra=(
                           "--set", "train.lr=.inf")), "--lr")),  # an explicit --lr flag would win over --set
                       ("train --step-decay 1e308", train_cmd(c, a, d / "t-inf", extra=("--step-decay", "1e308"))),
                       ("train --noise inf", train_cmd(c, a, d / "t-inf", extra=("--noise", "inf"))),
                       ("run --dry-run with lr: .inf in the config", c.cli("run", "--config", bad, "--dry-run"))):
        if not c.wanted(fault):
            continue
        t0 = time.monotonic()
        r = c.run(cmd)
        ok, text = clean_error(r, "lr" if "lr" in fault else ("step_decay" if "decay" in fault else "noise"))
        c.add(Row("settings", fault, "exit 2 naming the setting", text, ok, 0, command_text(cmd),
                  time.monotonic() - t0))


def write_foreign_draft(out: Path) -> Path:
    """A random EAGLE-3 draft in the original EAGLE format for SmolLM2 (hidden 576): a source for another verifier."""
    import torch
    from safetensors.torch import save_file

    if (out / "config.json").is_file():
        return out
    out.mkdir(parents=True, exist_ok=True)
    h, inter, vocab, dv = 576, 1536, 49152, 1024
    g = torch.Generator().manual_seed(0)

    def w(*shape: int) -> torch.Tensor:
        return (torch.randn(*shape, generator=g) * 0.02).contiguous()

    save_file({"fc.weight": w(h, 3 * h), "midlayer.input_layernorm.weight": torch.ones(h),
               "midlayer.hidden_norm.weight": torch.ones(h), "midlayer.post_attention_layernorm.weight": torch.ones(h),
               "midlayer.self_attn.q_proj.weight": w(576, 2 * h), "midlayer.self_attn.k_proj.weight": w(192, 2 * h),
               "midlayer.self_attn.v_proj.weight": w(192, 2 * h), "midlayer.self_attn.o_proj.weight": w(h, 576),
               "midlayer.mlp.gate_proj.weight": w(inter, h), "midlayer.mlp.up_proj.weight": w(inter, h),
               "midlayer.mlp.down_proj.weight": w(h, inter), "norm.weight": torch.ones(h), "lm_head.weight": w(dv, h),
               "d2t": torch.zeros(dv, dtype=torch.int64), "t2d": torch.arange(vocab) < dv},
              str(out / "model.safetensors"))
    (out / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "hidden_size": h,
        "num_attention_heads": 9, "num_key_value_heads": 3, "head_dim": 64, "intermediate_size": inter,
        "hidden_act": "silu", "num_hidden_layers": 1, "vocab_size": vocab, "draft_vocab_size": dv,
        "max_position_embeddings": 8192, "rope_theta": 100000.0, "rms_norm_eps": 1e-5, "tie_word_embeddings": False,
        "norm_before_residual": False, "eagle_config": {"use_aux_hidden_state": True}, "torch_dtype": "float32"}))
    return out


# --- report ---------------------------------------------------------------------------------------------------
def markdown(c: Campaign, started: str, seconds: float, stages: list[str]) -> str:
    lines = [f"Campaign run {started} UTC ({'short' if c.short else 'full'}, seed {c.seed}, stages "
             f"{', '.join(stages)}), {seconds / 60:.1f} min; {sum(r.ok for r in c.rows)}/{len(c.rows)} rows as "
             f"expected; data lost in total: {sum(r.lost or 0 for r in c.rows)}.", "",
             "| stage | fault / input | expected | how it was handled | lost | result | reproduce |",
             "|---|---|---|---|---|---|---|"]

    def cell(s: str) -> str:
        return str(s).replace("|", "\\|").replace("\n", " ")

    for r in c.rows:
        lines.append(f"| {cell(r.stage)} | {cell(r.fault)} | {cell(r.expected)} | {cell(r.handled)} | "
                     f"{'?' if r.lost is None else r.lost} | {'ok' if r.ok else '**FAIL**'} | `{cell(r.command)}` |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--short", action="store_true", help="1-2 kills per stage, smaller inputs (CI)")
    p.add_argument("--stages", default=",".join(STAGES), help=f"comma-separated subset of {','.join(STAGES)}")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="runs/reliability", help="work and result directory")
    p.add_argument("--kills", type=int, help="kills per stage (default 10, 2 with --short)")
    p.add_argument("--only", help="comma-separated words: run only the input rows whose fault names one (inputs stage)")
    p.add_argument("--report", nargs="+", metavar="RESULTS_JSON",
                   help="only merge the rows of earlier runs' results.json into OUT/results.md (and --docs)")
    p.add_argument("--docs", help="also write the table into this markdown file (default docs/RELIABILITY.md "
                                  "for a full run of every stage)")
    args = p.parse_args(argv)
    stages = [s.strip() for s in args.stages.split(",") if s.strip()]
    unknown = sorted(set(stages) - set(STAGES))
    if unknown:
        p.error(f"unknown stages {unknown}; known: {', '.join(STAGES)}")
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    c = Campaign(out, args.seed, args.short)
    if args.kills:
        c.kills = args.kills
    c.stages = stages
    c.only = [w.strip() for w in (args.only or "").split(",") if w.strip()]
    if args.report:
        merged = [json.loads(Path(f).read_text()) for f in args.report]
        c.rows = [Row(**r) for m in merged for r in m["rows"]]
        c.short = any(m["short"] for m in merged)
        c.stages = [s for m in merged for s in m["stages"]]
        table = markdown(c, ", ".join(m["started"] for m in merged), sum(m["seconds"] for m in merged), c.stages)
        (out / "results.md").write_text(table)
        if args.docs:
            write_docs(Path(args.docs), table, c)
        return 1 if any(not r.ok for r in c.rows) else 0
    a = build_assets(c)
    work: dict[str, Callable[[], None]] = {
        "kill-extract": lambda: kill_extract(c, a), "kill-train": lambda: kill_train(c, a),
        "kill-run": lambda: kill_run(c, a), "kill-generate": lambda: kill_generate(c, a),
        "inputs": lambda: inputs(c, a), "ownership": lambda: ownership(c, a), "replies": lambda: replies(c, a),
        "load": lambda: load_test(c)}
    for s in stages:
        print(f"== {s}", flush=True)
        try:
            work[s]()
        except Exception as e:  # noqa: BLE001 - a broken stage of the campaign is a row, not the end of it
            import traceback

            c.add(Row(s, "campaign stage crashed", "the stage runs", f"{type(e).__name__}: {e}"[:400], False, None,
                      f"python scripts/reliability_campaign.py --stages {s}",
                      details={"traceback": traceback.format_exc()[-3000:]}))
    table = c.save()
    docs = args.docs or (None if args.short or set(stages) != set(STAGES) else str(REPO / "docs" / "RELIABILITY.md"))
    if docs:
        write_docs(Path(docs), table, c)
    failed = [r for r in c.rows if not r.ok]
    print(f"\n{len(c.rows) - len(failed)}/{len(c.rows)} rows as expected, {sum(r.lost or 0 for r in c.rows)} lost; "
          f"results in {out}/results.md")
    return 1 if failed else 0


def write_docs(path: Path, table: str, c: Campaign) -> None:
    head = path.read_text().split("<!-- campaign table -->")[0] if path.is_file() else "# Reliability\n\n"
    path.write_text(head.rstrip() + "\n\n<!-- campaign table -->\n" + table)
    del c


if __name__ == "__main__":
    sys.exit(main())
