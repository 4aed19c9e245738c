"""`eagle3-train run --config FILE`: the whole pipeline on one YAML config, resumable stage by stage.

[generate ->] prepare -> vocab -> extract -> train -> export -> evaluate. On a rerun a stage is skipped when it ran
with the same settings and after every stage it reads; train resumes a run started with the same settings and sets
any other aside. Ends with a summary table.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import time
from pathlib import Path
from typing import Any

from eagle3_train.settings import SECTIONS, SHARED_SECTIONS, RunSettings
from eagle3_train.utils.config import apply_overrides, load_yaml
from eagle3_train.utils.io import (
    Eagle3InputError,
    claim_output_dir,
    has_file,
    read_json,
    set_aside,
    sha256_file,
    sha256_json,
    write_json,
)
from eagle3_train.utils.provenance import environment, now_iso
from eagle3_train.utils.settings import (
    add_settings_arguments,
    build_settings,
    explicit,
    unknown_key_error,
    yaml_keys,
)

log = logging.getLogger(__name__)

# Keys each section's settings hash has always included, set or not (older runs' pipeline_state.json stays valid);
# any other key counts once it is set. Their defaults come from the settings dataclasses.
_HASHED_KEYS: dict[str, tuple[str, ...]] = {
    "prepare": ("data", "limit", "max_length", "overflow", "val_fraction", "seed"), "generate": ("enabled",),
    "vocab": ("size",), "extract": ("dtype", "token_budget"), "train": (),
    "export": ("formats", "dtype", "speculative_tokens"), "evaluate": ("vllm", "offline")}


def merged_config(raw: dict[str, Any]) -> dict[str, Any]:
    """Check a run config against the settings dataclasses; each section becomes the dict of its hashed keys."""
    top = [f.name for f in dataclasses.fields(RunSettings)]
    for key in raw:
        if key not in SECTIONS and key not in SHARED_SECTIONS and key not in top:
            raise unknown_key_error(str(key), [*top, *SECTIONS, *SHARED_SECTIONS],
                                    "the top level of the config (sections and keys)")
    run = build_settings(RunSettings, {k: raw[k] for k in top if k in raw}, "the top level of the config")
    out: dict[str, Any] = dataclasses.asdict(run)
    for name, cls in SECTIONS.items():
        given = raw.get(name) or {}
        checked = build_settings(cls, given, f"config section '{name}'", yaml_only=True)
        out[name] = {k: getattr(checked, k) for k in yaml_keys(cls) if k in given or k in _HASHED_KEYS[name]}
    for name, cls in SHARED_SECTIONS.items():  # only the keys set: a stage's settings hash includes them if any
        given = raw.get(name) or {}
        checked = build_settings(cls, given, f"config section '{name}'", yaml_only=True)
        out[name] = {k: getattr(checked, k) for k in yaml_keys(cls) if k in given}
    return out


class Pipeline:
    def __init__(self, config: dict[str, Any]):
        self.cfg = merged_config(config)
        self.run_dir = Path(self.cfg["run_dir"])
        self.state_path = self.run_dir / "pipeline_state.json"
        self.state = read_json(self.state_path) if self.state_path.is_file() else {"stages": {}}
        self.summary: dict[str, Any] = {}

    def _done(self, stage: str, settings: dict[str, Any], output: Path, after: tuple[str, ...]) -> bool:
        rec = self.state["stages"].get(stage)
        if not (rec and rec["settings_sha256"] == sha256_json(settings) and output.exists()):
            return False
        # Same settings but an upstream stage ran again since: the output was made from other inputs.
        # Nanoseconds: fast stages finish within the same second (older state files: the ISO time).
        def when(r: dict[str, Any]) -> tuple[int, str]:
            return r.get("finished_ns", 0), r.get("finished", "")
        return all(when(self.state["stages"].get(up, {})) <= when(rec) for up in after)

    def _record(self, stage: str, settings: dict[str, Any], seconds: float, result: Any = None) -> None:
        self.state["stages"][stage] = {"settings_sha256": sha256_json(settings), "finished": now_iso(),
                                       "finished_ns": time.time_ns(),
                                       "seconds": round(seconds, 1), "result": result}
        write_json(self.state_path, self.state)

    def stage(self, name: str, settings: dict[str, Any], output: Path, fn, after: tuple[str, ...] = ()) -> Any:
        """Run `fn` unless it already ran with these settings and after every stage it reads (`after`)."""
        if self._done(name, settings, output, after):
            log.info("[%s] already done with these settings -> %s (skipped)", name, output)
            return self.state["stages"][name].get("result")
        log.info("[%s] starting -> %s", name, output)
        t0 = time.time()
        result = fn()
        self._record(name, settings, time.time() - t0, result)
        log.info("[%s] done in %.0f s", name, time.time() - t0)
        return result

    # --- stages -------------------------------------------------------------------------------------------------
    def run(self) -> dict[str, Any]:
        cfg, rd = self.cfg, self.run_dir
        claim_output_dir(rd, "run_dir", has_file("pipeline_state.json", "pipeline_config.json"))
        rd.mkdir(parents=True, exist_ok=True)
        write_json(rd / "pipeline_config.json", {"config": cfg, "environment": environment(), "time": now_iso()})
        trc = bool(cfg["trust_remote_code"])  # not in the stage keys: it lets code run, it does not change outputs
        from eagle3_train.assets.verifier import Verifier

        verifier = Verifier.resolve(cfg["verifier"])  # once for every stage; manifests record verifier.name
        verifier_dir = verifier.path
        # Stages are keyed on what they read, not on names: a verifier or data file changed in place reruns them.
        self.verifier_key = verifier.stage_key()
        prep = dict(cfg["prepare"])
        data_source = prep.pop("data")
        gen = dict(cfg["generate"])
        if gen.pop("enabled", False):
            data_source = self._generate(data_source, verifier_dir, gen)
        prepared = rd / "prepared"
        p_settings = {"data": str(data_source), "data_sha256": data_sha256(data_source),
                      "verifier": self.verifier_key, **prep}
        from eagle3_train.data.prepare import prepare

        manifest = self.stage("prepare", p_settings, prepared / "manifest.json",
                              lambda: _counts(prepare(data_source, verifier, prepared, **prep,
                                                      trust_remote_code=trc)),
                              after=("generate",))
        self.summary["data"] = manifest

        vocab_dir = rd / "vocab"
        v_settings = {**cfg["vocab"], "prepared": p_settings}
        from eagle3_train.vocab.build import build_vocab

        self.summary["vocab"] = self.stage("vocab", v_settings, vocab_dir / "vocab.safetensors",
                                           lambda: _vocab_summary(build_vocab(prepared, vocab_dir,
                                                                              overwrite=True, **cfg["vocab"])),
                                           after=("prepare",))

        hidden = rd / "hidden_states"
        e_settings = {**cfg["extract"], "prepared": p_settings, "verifier": self.verifier_key}
        from eagle3_train.hidden_states.extract import extract

        self.summary["extract"] = self.stage(
            "extract", e_settings, hidden / "manifest.json",
            lambda: _extract_summary(extract(prepared, verifier, hidden, **cfg["extract"], trust_remote_code=trc,
                                             overwrite=self._restarts("extract", e_settings))), after=("prepare",))

        train_out = rd / "train"
        t_values = {"prepared": str(prepared), "hidden_states": str(hidden), "vocab": str(vocab_dir),
                    "out": str(train_out), "verifier": verifier.name, **cfg["train"]}
        t_settings = {**t_values, "inputs": [p_settings, e_settings, v_settings]}
        self.summary["train"] = self.stage("train", t_settings, train_out / "final",
                                           lambda: self._train(t_values, train_out, t_settings),
                                           after=("prepare", "vocab", "extract"))

        exports: dict[str, str] = {}
        ex = dict(cfg["export"])
        formats = ex.pop("formats")
        from eagle3_train.export.exporter import export

        for fmt in formats:
            out = rd / f"export-{fmt}"
            res = self.stage(f"export-{fmt}", {**ex, "format": fmt, "train": t_settings}, out / "config.json",
                             lambda fmt=fmt, out=out: export(train_out, out, fmt=fmt, verifier=verifier,
                                                             overwrite=True, **ex), after=("train",))
            exports[fmt] = res["out"]
            self.summary.setdefault("serve", {})[fmt] = res["serve"]
        self.summary["exports"] = exports
        self._evaluate(exports, verifier_dir, t_settings)
        write_json(rd / "summary.json", self.summary)
        print(format_summary(self.summary))
        return self.summary

    def dry_run(self) -> dict[str, Any]:
        """Validate the config and report which stages would run; when prepare, vocab and extract are done, run
        `train --dry-run` on their outputs (nothing else is written)."""
        from eagle3_train.assets.verifier import Verifier
        from eagle3_train.train.config import TrainConfig
        from eagle3_train.train.dry_run import dry_run, format_report

        cfg, rd = self.cfg, self.run_dir
        verifier_dir = Verifier.resolve(cfg["verifier"]).path
        t_values = {"prepared": str(rd / "prepared"), "hidden_states": str(rd / "hidden_states"),
                    "vocab": str(rd / "vocab"), "out": str(rd / "train"), "verifier": str(cfg["verifier"]),
                    "trust_remote_code": bool(cfg["trust_remote_code"]), **cfg["train"]}
        train_cfg = build_settings(TrainConfig, t_values, "config section 'train'")
        done = {name: name in self.state["stages"] and out.exists()
                for name, out in (("prepare", rd / "prepared" / "manifest.json"),
                                  ("vocab", rd / "vocab" / "vocab.safetensors"),
                                  ("extract", rd / "hidden_states" / "manifest.json"))}
        lines = [f"run --dry-run: config valid, verifier {verifier_dir}"]
        lines += [f"  {k}: {'done (its output is checked by the train dry run)' if v else 'would run'}"
                  for k, v in done.items()]
        report: dict[str, Any] = {"stages_done": done}
        if all(done.values()):
            report["train"] = dry_run(train_cfg)
            lines.append(format_report(report["train"]))
        else:
            lines.append("NOT checked: train (its inputs do not exist yet: run the pipeline up to extract, or "
                         "`eagle3-train train --dry-run` on existing outputs), export, evaluate")
        print("\n".join(lines))
        return report

    def _generate(self, data_source: str, verifier_dir: Path, gen: dict[str, Any]) -> str:
        from eagle3_train.generate.pipeline_step import run_generation_for_pipeline

        out = self.run_dir / "generated"
        fallback = bool(gen.pop("allow_fallback", False))
        serving = self.cfg.get("serving") or {}
        settings = {"data": data_source, "data_sha256": data_sha256(data_source), "verifier": self.verifier_key,
                    **gen, **({"serving": serving} if serving else {})}
        result = self.stage("generate", settings, out / "conversations.jsonl",
                            lambda: run_generation_for_pipeline(data_source, verifier_dir, out, gen, serving,
                                                                bool(self.cfg["trust_remote_code"])))
        if not result or result.get("skipped"):
            reason = (result or {}).get("reason")
            if not fallback:  # on-policy data was asked for: never train off-policy without saying so in the config
                self.state["stages"].pop("generate", None)
                write_json(self.state_path, self.state)
                raise Eagle3InputError(f"generate.enabled is true but generation cannot run: {reason}. Set "
                                       f"generate.allow_fallback: true to train on the original answers instead.")
            log.warning("generation skipped (%s); training on the original answers (generate.allow_fallback)",
                        reason)
            self.summary["generate"] = result
            return data_source
        self.summary["generate"] = result
        return str(out / "conversations.jsonl")

    def _restarts(self, stage: str, settings: dict[str, Any]) -> bool:
        """Record that `stage` starts with these settings; True unless its output was started with these very
        settings and inputs (an interrupted run to resume)."""
        started, sha = self.state.setdefault("started", {}), sha256_json(settings)
        restart = started.get(stage) != sha
        started[stage] = sha
        write_json(self.state_path, self.state)
        return restart

    def _train(self, values: dict[str, Any], out: Path, settings: dict[str, Any]) -> dict[str, Any]:
        from eagle3_train.train.config import TrainConfig
        from eagle3_train.train.trainer import train
        cfg = build_settings(TrainConfig, values, "config section 'train'")
        # Resume only a run that was started with these very settings (an interrupted one); a run with other settings
        # (or of unknown origin) is set aside, never continued with the new settings and never deleted.
        if self._restarts("train", settings) and out.exists():
            aside = set_aside(out)
            log.warning("[train] %s holds a run with other settings: moved it to %s, training from the start",
                        out, aside)
        cfg.resume = (out / "checkpoints" / "latest.json").is_file()
        cfg.trust_remote_code = bool(self.cfg["trust_remote_code"])  # recorded in the training metadata
        r = train(cfg)
        return {"tokens_per_s": r["tokens_per_s"], "steps": r["step"], "validation": r["validation"],
                "best": r["best"], "final": r.get("final")}

    def _evaluate(self, exports: dict[str, str], verifier_dir: Path, t_settings: dict[str, Any]) -> None:
        ev = dict(self.cfg["evaluate"])
        run_vllm, run_offline = ev.pop("vllm"), ev.pop("offline")
        if not (run_vllm or run_offline):
            return
        from eagle3_train.evaluate.pipeline_eval import pipeline_evaluate

        serving = self.cfg.get("serving") or {}
        settings = {**ev, "vllm": run_vllm, "offline": run_offline, "train": t_settings,
                    **({"serving": serving} if serving else {})}
        self.summary["evaluate"] = self.stage(
            "evaluate", settings, self.run_dir / "evaluate" / "results.json",
            lambda: pipeline_evaluate(exports, verifier_dir, self.run_dir / "evaluate", vllm=run_vllm,
                                      offline=run_offline, serving=serving,
                                      trust_remote_code=bool(self.cfg["trust_remote_code"]), **ev),
            after=tuple(f"export-{fmt}" for fmt in exports))


def data_sha256(source: str | Path) -> str:
    from eagle3_train.assets.conversations import resolve_source

    return sha256_file(resolve_source(source))


def _counts(manifest: dict[str, Any]) -> dict[str, Any]:
    return {"counts": manifest.get("counts"), "source": manifest.get("source")}


def _vocab_summary(m: dict[str, Any]) -> dict[str, Any]:
    return {k: m.get(k) for k in ("draft_vocab_size", "coverage", "sha256") if k in m} or m


def _extract_summary(m: dict[str, Any]) -> dict[str, Any]:
    return {"counts": m.get("counts"), "throughput": m.get("throughput"), "layer_ids": m.get("layer_ids")}


def format_summary(s: dict[str, Any]) -> str:
    rows: list[tuple[str, str]] = []
    counts = ((s.get("data") or {}).get("counts")) or {}
    rows.append(("data", json.dumps(counts, default=str)[:200]))
    ext = s.get("extract") or {}
    if ext.get("throughput"):
        rows.append(("extract", json.dumps(ext["throughput"], default=str)[:200]))
    tr = s.get("train") or {}
    if tr:
        rows.append(("training tokens/s", f"{tr.get('tokens_per_s', 0):.0f}"))
        val = tr.get("validation") or {}
        ests = {k: round(v, 3) for k, v in val.items() if k.startswith("accept_len_k")}
        rows.append(("estimated acceptance length (validation)", json.dumps(ests)))
    ev = s.get("evaluate") or {}
    for name, res in ev.items():
        if isinstance(res, dict) and "mean_acceptance_length" in res:
            rows.append((f"acceptance length: {name}", f"{res['mean_acceptance_length']:.3f}"))
    for fmt, path in (s.get("exports") or {}).items():
        rows.append((f"exported draft ({fmt})", path))
    for fmt, cmd in (s.get("serve") or {}).items():
        rows.append((f"serve with vLLM ({fmt})", cmd))
    width = max(len(r[0]) for r in rows)
    lines = ["", "=" * 100, "eagle3-train run summary", "-" * 100]
    lines += [f"{k.ljust(width)}  {v}" for k, v in rows]
    lines.append("=" * 100)
    return "\n".join(lines)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", required=True, help="YAML run config (see configs/ and docs/CONFIG.md)")
    p.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE",
                   help="override a setting of a section (values read as YAML; an unknown key is an error)")
    add_settings_arguments(p, RunSettings, set_option=False)  # --run-dir, --verifier: override the config's


def main(args: argparse.Namespace) -> int:
    raw = apply_overrides(load_yaml(args.config), args.set)
    raw.update({k: getattr(args, k) for k in explicit(args) if k != "dry_run"})
    if getattr(args, "dry_run", False):
        Pipeline(raw).dry_run()
        return 0
    Pipeline(raw).run()
    return 0
