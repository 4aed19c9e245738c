"""`eagle3-train run --config FILE`: the whole pipeline on one YAML config, resumable stage by stage.

[generate ->] prepare -> vocab -> extract -> train -> export -> evaluate, declared in `STAGES` (one `Stage` entry
each: name, settings section, the stages it reads, the output it writes, how its key is computed, the function it
runs); `Pipeline.run` loops over that list. On a rerun a stage is skipped when it ran with the same key (settings and
the keys of what it reads) and after every stage it reads; train resumes a run started with the same key and sets
any other aside. `run --dry-run` prints the plan. Ends with a summary table.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml

from eagle3_train.settings import SECTIONS, SHARED_SECTIONS, ExtractSettings, PrepareSettings, RunSettings
from eagle3_train.utils.config import apply_overrides, load_yaml
from eagle3_train.utils.io import Eagle3InputError, read_json, sha256_file, sha256_json, write_json
from eagle3_train.utils.outputs import claim_output_dir, claimed_output, has_file, own, set_aside
from eagle3_train.utils.provenance import environment, now_iso
from eagle3_train.utils.settings import (
    add_settings_arguments,
    build_settings,
    explicit,
    unknown_key_error,
    yaml_keys,
)

if TYPE_CHECKING:
    from eagle3_train.assets.verifier import Verifier

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



def _finetune_source_checks(ctx: RunContext) -> list[str]:
    """A finetune source read (headers only) and fitted to the verifier before anything runs; the layers extract
    will tap are its own."""
    source = ctx.cfg["train"].get("finetune_from")
    if not source:
        return []
    from eagle3_train.checkpoints.fit import check_draft_fits_verifier, verifier_dims
    from eagle3_train.checkpoints.formats import fill_default_aux_ids, load_draft_source

    convention = _aux_convention(ctx)
    loaded = load_draft_source(source, shapes_only=True, aux_convention=convention)
    fill_default_aux_ids(loaded.config, verifier_dims(ctx.verifier.config)[2])
    check_draft_fits_verifier(loaded.config, ctx.verifier.config, f"train.finetune_from {source}", ctx.verifier.name,
                              {**loaded.tensors, **loaded.extra}, loaded.source_name)
    layers = _extract_layers(ctx, {**ctx.cfg["extract"], "finetune_from": source,
                                   "source_aux_convention": convention})
    return [f"  train: finetunes {source} ({loaded.format} format, {loaded.config.architecture} layer); extract taps "
            f"its layers {layers} ({loaded.aux_ids_origin})"]


def _check_stage_settings(ctx: RunContext, train_cfg: Any) -> None:
    """What each stage checks of its own settings before it reads anything, checked before any stage runs (the
    sections' types and ranges are checked when the config is read)."""
    from eagle3_train.data.prepare import check_prepare_settings
    from eagle3_train.utils.distributed import check_device

    p = build_settings(PrepareSettings, ctx.cfg["prepare"], "config section 'prepare'", yaml_only=True)
    check_prepare_settings(p.max_length, p.overflow, p.val_fraction, p.val_count, p.leading_assistant, p.reasoning)
    ext = build_settings(ExtractSettings, ctx.cfg["extract"], "config section 'extract'", yaml_only=True)
    check_device(ext.device, "extract.device")
    check_device(train_cfg.device, "train.device")

# The run directory's own files, beside one directory per stage (listed as each stage starts).
_RUN_FILES = ("pipeline_state.json", "pipeline_config.json", "summary.json", "hidden-states-transfer",
              "vllm-extract.log", "vllm-train.log", "train-launch.yaml")

class StageRefused(Eagle3InputError):
    """A stage's result cannot be used (generation skipped without generate.allow_fallback): it is forgotten, so the
    next run tries it again."""


class Pipeline:
    def __init__(self, config: dict[str, Any]):
        self.cfg = merged_config(config)
        self.run_dir = Path(self.cfg["run_dir"])
        self.state_path = self.run_dir / "pipeline_state.json"
        self.state = read_json(self.state_path) if self.state_path.is_file() else {"stages": {}}
        self.summary: dict[str, Any] = {}

    def _done(self, stage: str, settings: dict[str, Any], output: Path, after: tuple[str, ...]) -> bool:
        rec = self.state["stages"].get(stage)
        if not (rec and rec.get("settings_sha256") == sha256_json(settings) and output.exists()):
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

    def _restarts(self, stage: str, settings: dict[str, Any]) -> bool:
        """Record that `stage` starts with these settings; True unless its output was started with these very
        settings and inputs (an interrupted run to resume)."""
        started, sha = self.state.setdefault("started", {}), sha256_json(settings)
        restart = started.get(stage) != sha
        started[stage] = sha
        write_json(self.state_path, self.state)
        return restart

    def _context(self, need: str = "weights") -> RunContext:
        from eagle3_train.assets.verifier import Verifier

        verifier = Verifier.resolve(self.cfg["verifier"], need)  # once for every stage; manifests record its name
        # Stages are keyed on what they read, not on names: a verifier or data file changed in place reruns them.
        self.verifier_key = verifier.stage_key()
        return RunContext(cfg=self.cfg, run_dir=self.run_dir, verifier=verifier, verifier_dir=verifier.path,
                          verifier_key=self.verifier_key, pipeline=self, data_source=self.cfg["prepare"]["data"],
                          summary=self.summary)

    @staticmethod
    def _reads(ctx: RunContext, stage: Stage) -> tuple[str, ...]:
        """The state names of the stage instances `stage` reads (every variant of a stage with variants)."""
        by_name = {s.name: s for s in STAGES}
        return tuple(name for r in stage.reads for name, _ in by_name[r].instances(ctx))

    def run(self) -> dict[str, Any]:
        """Every enabled stage of STAGES in order, each skipped when done (see `stage`)."""
        rd = self.run_dir
        with claimed_output(rd, "run", "run_dir", has_file("pipeline_state.json", "pipeline_config.json"),
                            writes=_RUN_FILES):
            return self._run_stages(rd)

    def _run_stages(self, rd: Path) -> dict[str, Any]:
        write_json(rd / "pipeline_config.json", {"config": self.cfg, "environment": environment(), "time": now_iso()})
        ctx = self._context()
        for st in STAGES:
            if not st.enabled(ctx):
                continue
            for name, variant in st.instances(ctx):
                key = ctx.keys[name] = st.key(ctx, variant)
                own(rd, "run", [st.out_dir(ctx, variant).name])  # listed before the stage writes it
                result = self.stage(name, key, st.output(ctx, variant), partial(st.run, ctx, variant),
                                    after=self._reads(ctx, st))
                try:
                    st.use(ctx, variant, result)
                except StageRefused:
                    self.state["stages"].pop(name, None)
                    write_json(self.state_path, self.state)
                    raise
        self.summary.setdefault("exports", {})
        write_json(rd / "summary.json", self.summary)
        print(format_summary(self.summary))
        return self.summary

    def dry_run(self) -> dict[str, Any]:
        """Validate the config and print the plan: which stages are done and which would run (and why); when
        prepare, vocab and extract have outputs, run `train --dry-run` on them (nothing else is written)."""
        from eagle3_train.settings.train import TrainConfig
        from eagle3_train.train.dry_run import dry_run, format_report

        ctx = self._context(need="tokenizer")  # a hub verifier's weights are not downloaded to check a config
        train_cfg = build_settings(TrainConfig, {**_train_values(ctx), "trust_remote_code": ctx.trust_remote_code},
                                   "config section 'train'")
        _check_stage_settings(ctx, train_cfg)
        steps = self.plan(ctx)
        lines = [f"run --dry-run: config valid, verifier {ctx.verifier_dir}"]
        lines += [f"  {name}: {status} -> {where}" for name, (status, where) in steps.items()]
        lines += self._server_checks(ctx)
        lines += _finetune_source_checks(ctx)
        plan = {name: status for name, (status, _) in steps.items()}
        needed = ("prepare", "vocab", "extract") if _states_mode(ctx) == "offline" else ("prepare", "vocab")
        done = {name: plan[name].startswith("done") for name in needed}
        report: dict[str, Any] = {"stages_done": done, "plan": plan}
        served_here = _states_mode(ctx) != "offline" and not ctx.cfg["train"].get("endpoint")
        if served_here:
            lines.append("NOT checked: train (its hidden-state server starts with the run; `eagle3-train train "
                         "--dry-run --endpoint URL ...` checks it against a running one), export, evaluate")
        elif all(done.values()):
            lines.append(f"  (the outputs of {', '.join(needed)} are checked by the train dry run)")
            report["train"] = dry_run(train_cfg)
            lines.append(format_report(report["train"]))
        else:
            lines.append("NOT checked: train (its inputs do not exist yet: run the pipeline up to extract, or "
                         "`eagle3-train train --dry-run` on existing outputs), export, evaluate")
        print("\n".join(lines))
        return report

    def _server_checks(self, ctx: RunContext) -> list[str]:
        """Where the hidden states come from, checked before a run that would otherwise fail after hours: the given
        servers answer, or the vLLM environment that the run would start one with exists."""
        ext, tr = ctx.cfg["extract"], ctx.cfg["train"]
        if _states_mode(ctx) != "offline":
            if tr.get("endpoint"):
                return [f"  train: {_states_mode(ctx)} mode, states from the servers {tr['endpoint']} (the train dry "
                        f"run asks them)"]
            _check_local_server(f"train.hidden_states_mode is {_states_mode(ctx)}")
            return [f"  train: {_states_mode(ctx)} mode, states from a vLLM hidden-state server the run starts here",
                    served_beside_training(ctx)]
        if ext.get("backend") != "vllm":
            return [f"  extract: the verifier runs here (HF backend, device {ext.get('device')})"]
        if ext.get("endpoint"):
            from eagle3_train.hidden_states.vllm_backend import VLLMHiddenStates

            client = VLLMHiddenStates(ext["endpoint"], ctx.verifier_dir, [0], torch_dtype(ext["dtype"]),
                                      model=ext.get("model"), hidden_states_dir=ext.get("hidden_states_dir"))
            try:
                servers = client.open()  # raises, naming the endpoint, when one does not answer
            finally:
                client.close()
            return [f"  extract: states from the vLLM servers {ext['endpoint']}: answered (model {servers['model']}, "
                    f"vLLM {servers['vllm_version']})"]
        _check_local_server("extract.backend is vllm")
        return ["  extract: states from a vLLM hidden-state server the run starts here (serving section)"]

    def plan(self, ctx: RunContext | None = None) -> dict[str, tuple[str, str]]:
        """{stage instance: (what `run` would do with it, its output under run_dir)}, computed as `run` decides but
        running nothing."""
        ctx = ctx or self._context()
        plan: dict[str, tuple[str, str]] = {}
        for st in STAGES:
            for name, variant in st.instances(ctx):
                plan[name] = (self._plan(ctx, st, name, variant, {k: v[0] for k, v in plan.items()}),
                              st.writes.format(variant=variant))
        return plan

    def _plan(self, ctx: RunContext, st: Stage, name: str, variant: str | None, plan: dict[str, str]) -> str:
        """What `run` would do with this stage instance, computed as `run` does but without running anything."""
        if not st.enabled(ctx):
            return f"off (section '{st.section}')"
        try:
            key = ctx.keys[name] = st.key(ctx, variant)
        except (Eagle3InputError, OSError) as e:  # e.g. data that an earlier stage has yet to write
            key = ctx.keys[name] = None
            log.debug("[%s] key not computable yet: %s", name, e)
        rec, output = self.state["stages"].get(name), st.output(ctx, variant)
        if rec is None or not output.exists():
            return "would run"
        reads = self._reads(ctx, st)
        first = [r for r in reads if plan.get(r, "").startswith(("would run", "done, but"))]
        if key is None or first or not self._done(name, key, output, reads):
            why = f"{', '.join(first)} run(s) first" if first else "its settings or what it reads changed"
            return f"done, but would run again ({why})"
        try:
            st.use(ctx, variant, rec.get("result"))
        except Eagle3InputError as e:
            return f"would run ({e})"
        return "done (skipped)"


def served_beside_training(ctx: RunContext, gpu_bytes: int | None = None) -> str:
    """An online/hybrid run that starts its own server puts it on the training GPUs: the trainer's planned peak per
    rank plus the server's share of the weights must fit one GPU (`gpu_bytes`; default: this machine's first GPU),
    else the run is refused before it starts (595 GB of Kimi-K2.5 over 8 GPUs is 74 GB each, beside training)."""
    from eagle3_train.plan import PlanSettings, plan
    from eagle3_train.settings.train import TrainConfig

    if gpu_bytes is None:
        import torch

        gpu_bytes = torch.cuda.get_device_properties(0).total_memory if torch.cuda.is_available() else None
    tr, prep = ctx.cfg["train"], ctx.cfg["prepare"]
    gpus = train_processes(ctx.cfg.get("train_processes", "auto"))
    p = plan(PlanSettings(verifier=str(ctx.verifier_dir), samples=1, gpus=gpus,
                          tokens_per_sample=int(prep.get("max_length") or PrepareSettings.max_length),
                          token_budget=int(tr.get("token_budget") or TrainConfig.token_budget),
                          ttt_steps=int(tr.get("ttt_steps") or TrainConfig.ttt_steps),
                          finetune_from=tr.get("finetune_from"),
                          source_aux_convention=_aux_convention(ctx),
                          gpu_memory_gb=None if gpu_bytes is None else gpu_bytes / 1e9))
    share = p.modes["online"]["server_memory_per_gpu"]
    floor = share.get("at_least_bytes")
    what = (f"the server's weights {floor / 1e9:.1f} GB per GPU over {gpus} beside the trainer's planned peak "
            f"{p.memory['peak'] / 1e9:.1f} GB" if floor else "the server's weight size is unknown (config only)")
    if p.modes["online"]["fits"] is False:
        raise Eagle3InputError(f"train.hidden_states_mode {_states_mode(ctx)} starts the verifier's server on the "
                               f"training GPUs: {what} exceed one GPU's {gpu_bytes / 1e9:.1f} GB. Run the servers on "
                               f"other GPUs and give train.endpoint, or train offline (extract first)")
    if gpu_bytes is None:
        return f"  NOT checked: {what} against GPU memory (no GPU here)"
    return f"  train: {what} fit one GPU's {gpu_bytes / 1e9:.1f} GB (before the server's KV cache)"


def _check_local_server(setting: str) -> None:
    """A run that starts its own hidden-state server needs the vLLM environment: say so before it starts."""
    from eagle3_train.serving.vllm_server import vllm_available

    ok, message = vllm_available()
    if not ok:
        raise Eagle3InputError(f"{setting} without endpoints, so the run would start a hidden-state server here, but "
                               f"{message}")


# --- the stages -----------------------------------------------------------------------------------------------------
@dataclass
class RunContext:
    """What the stages of one run share: the checked config, the verifier, and the keys and results so far."""
    cfg: dict[str, Any]
    run_dir: Path
    verifier: Verifier  # resolved once; .name is what the user gave
    verifier_dir: Path
    verifier_key: dict[str, Any]
    pipeline: Pipeline
    data_source: str = ""  # what prepare reads: the configured data, or generate's output
    keys: dict[str, dict[str, Any]] = field(default_factory=dict)  # stage name -> the key it ran (or was kept) with
    summary: dict[str, Any] = field(default_factory=dict)

    @property
    def trust_remote_code(self) -> bool:  # not in the stage keys: it lets code run, it does not change outputs
        return bool(self.cfg["trust_remote_code"])

    def serving(self) -> dict[str, Any]:
        return self.cfg.get("serving") or {}


@dataclass(frozen=True)
class Stage:
    """One entry of the pipeline: the runner skips it when its key matches the recorded one, its output exists and
    every stage it reads finished before it; otherwise it runs `run` and records the key and result."""
    name: str  # its entry in pipeline_state.json (`NAME-VARIANT` for stages with variants)
    section: str  # the config section of its settings
    reads: tuple[str, ...]  # stages whose outputs it reads: one that ran later makes it run again
    writes: str  # its output under run_dir ({variant} filled in); missing = not done
    key: Callable[[RunContext, str | None], dict[str, Any]]  # what it depends on: settings and the keys it reads
    run: Callable[[RunContext, str | None], Any]  # does the work; the result is recorded (JSON)
    use: Callable[[RunContext, str | None, Any], None] = lambda ctx, variant, result: None  # result -> summary
    enabled: Callable[[RunContext], bool] = lambda ctx: True
    variants: Callable[[RunContext], list[str]] | None = None  # one entry per variant (export: per format)

    def instances(self, ctx: RunContext) -> list[tuple[str, str | None]]:
        """(state name, variant) of each instance this run has."""
        if self.variants is None:
            return [(self.name, None)]
        return [(f"{self.name}-{v}", v) for v in self.variants(ctx)]

    def output(self, ctx: RunContext, variant: str | None) -> Path:
        return ctx.run_dir / self.writes.format(variant=variant)

    def out_dir(self, ctx: RunContext, variant: str | None) -> Path:
        return ctx.run_dir / self.writes.format(variant=variant).split("/")[0]


def _section(ctx: RunContext, name: str, *drop: str) -> dict[str, Any]:
    return {k: v for k, v in ctx.cfg[name].items() if k not in drop}


def _with_serving(ctx: RunContext) -> dict[str, Any]:
    return {"serving": ctx.serving()} if ctx.serving() else {}


# generate: regenerate the assistant turns with the verifier served by vLLM (on-policy data).
_GENERATE_PIPELINE_ONLY = ("enabled", "allow_fallback", "original_answers")  # how the run uses generate's output


def _generate_key(ctx: RunContext, _v: str | None) -> dict[str, Any]:
    source = ctx.cfg["prepare"]["data"]
    return {"data": source, "data_sha256": data_sha256(source), "verifier": ctx.verifier_key,
            **_section(ctx, "generate", *_GENERATE_PIPELINE_ONLY), **_with_serving(ctx)}


def _generate_run(ctx: RunContext, _v: str | None) -> Any:
    from eagle3_train.generate.pipeline_step import run_generation_for_pipeline

    return run_generation_for_pipeline(ctx.cfg["prepare"]["data"], ctx.verifier_dir, ctx.run_dir / "generated",
                                       _section(ctx, "generate", *_GENERATE_PIPELINE_ONLY), ctx.serving(),
                                       ctx.trust_remote_code)


def _generate_use(ctx: RunContext, _v: str | None, result: Any) -> None:
    if not result or result.get("skipped"):
        reason = (result or {}).get("reason")
        if not ctx.cfg["generate"].get("allow_fallback"):
            # on-policy data was asked for: never train off-policy without saying so in the config
            raise StageRefused(f"generate.enabled is true but generation cannot run: {reason}. Set "
                               f"generate.allow_fallback: true to train on the original answers instead.")
        log.warning("generation skipped (%s); training on the original answers (generate.allow_fallback)", reason)
    else:
        ctx.data_source = str(ctx.run_dir / "generated" / "conversations.jsonl")
        if ctx.cfg["generate"].get("original_answers"):
            from eagle3_train.generate.pipeline_step import mix_with_originals

            mixed = ctx.run_dir / "generated" / "with-original-answers.jsonl"
            result = {**result, "mix": mix_with_originals(
                ctx.cfg["prepare"]["data"], Path(ctx.data_source), mixed, ctx.cfg["prepare"].get("limit"),
                bool(ctx.cfg["prepare"].get("skip_bad_records")))}
            ctx.data_source = str(mixed)
    ctx.summary["generate"] = result


# prepare: tokenize with the verifier's chat template and the loss mask.
def _prepare_key(ctx: RunContext, _v: str | None) -> dict[str, Any]:
    return {"data": str(ctx.data_source), "data_sha256": data_sha256(ctx.data_source), "verifier": ctx.verifier_key,
            **_section(ctx, "prepare", "data")}


def _prepare_run(ctx: RunContext, _v: str | None) -> Any:
    from eagle3_train.data.prepare import prepare

    return _counts(prepare(ctx.data_source, ctx.verifier, ctx.run_dir / "prepared", **_section(ctx, "prepare", "data"),
                           trust_remote_code=ctx.trust_remote_code, overwrite=True))  # the run's own, redone on change


def _vocab_run(ctx: RunContext, _v: str | None) -> Any:
    from eagle3_train.vocab.build import build_vocab

    return _vocab_summary(build_vocab(ctx.run_dir / "prepared", ctx.run_dir / "vocab", overwrite=True,
                                      **ctx.cfg["vocab"]))


# How extract reaches its servers (not what it stores): left out of the stage's key.
_EXTRACT_TRANSPORT = ("endpoint", "model", "concurrency", "hidden_states_dir")


def _aux_convention(ctx: RunContext) -> str:
    """train.source_aux_convention: how the finetune source's aux ids are meant (extract reads the source the same)."""
    return ctx.cfg["train"].get("source_aux_convention") or "auto"


def _extract_key(ctx: RunContext, _v: str | None) -> dict[str, Any]:
    key = {**_section(ctx, "extract", *_EXTRACT_TRANSPORT), "prepared": ctx.keys["prepare"],
           "verifier": ctx.verifier_key, "layers_of": ctx.cfg["train"].get("finetune_from")}
    if _aux_convention(ctx) != "auto":  # the user's reading of the source's ids
        key["layers_convention"] = _aux_convention(ctx)
    return key | (_with_serving(ctx) if ctx.cfg["extract"].get("backend") == "vllm" else {})


def _extract_layers(ctx: RunContext, cfg: dict[str, Any]) -> Any:
    """The layers the extract stage taps: its own setting, else the finetune source's (None: the default)."""
    if cfg.get("layer_ids") is not None or not cfg.get("finetune_from"):
        return cfg.get("layer_ids")
    from eagle3_train.assets.families import text_config
    from eagle3_train.checkpoints.formats import draft_layer_ids

    layers = text_config(ctx.verifier.config)["num_hidden_layers"]
    return list(draft_layer_ids(cfg["finetune_from"], int(layers), cfg.get("source_aux_convention") or "auto")[0])


def _extract_run(ctx: RunContext, _v: str | None) -> Any:
    from eagle3_train.hidden_states.extract import extract

    restart = ctx.pipeline._restarts("extract", ctx.keys["extract"])  # else: resume an interrupted extraction
    cfg = _section(ctx, "extract", *_EXTRACT_TRANSPORT)
    # A finetune trains on its source's layers: extract those (as `extract --finetune-from` does), not the default
    # ones the train stage would refuse after the whole extraction.
    cfg["finetune_from"] = ctx.cfg["train"].get("finetune_from")
    cfg["source_aux_convention"] = _aux_convention(ctx)
    out = ctx.run_dir / "hidden_states"
    kw = dict(trust_remote_code=ctx.trust_remote_code, overwrite=restart)
    ext = ctx.cfg["extract"]
    if cfg.get("backend") != "vllm":
        processes = train_processes(ctx.cfg.get("train_processes", "auto"))
        if processes > 1:  # one verifier replica per GPU, disjoint shards, one store (hidden_states/parallel.py)
            args = ["--prepared", str(ctx.run_dir / "prepared"), "--verifier", ctx.verifier.name, "--out", str(out),
                    *(["--overwrite"] if restart else []), *(["--trust-remote-code"] if ctx.trust_remote_code else []),
                    *(["--finetune-from", cfg["finetune_from"]] if cfg["finetune_from"] else []),
                    "--source-aux-convention", cfg["source_aux_convention"],
                    *(a for k, v in cfg.items()
                      if v is not None and k not in ("finetune_from", "source_aux_convention")
                      for a in ("--set", f"extract.{k}={yaml.safe_dump(v, default_flow_style=True).strip()}"))]
            under_torchrun("extract", args, processes)
            return _extract_summary(read_json(out / "manifest.json", "hidden-states manifest"))
        return _extract_summary(extract(ctx.run_dir / "prepared", ctx.verifier, out, **cfg, **kw))
    options = {k: ext[k] for k in ("model", "concurrency", "hidden_states_dir") if ext.get(k) is not None}
    if ext.get("endpoint"):  # the user's servers (a multi-GPU verifier): their storage dir is given
        return _extract_summary(extract(ctx.run_dir / "prepared", ctx.verifier, out, **cfg, **kw,
                                        endpoints=ext["endpoint"], vllm_options=options))
    # no endpoint: serve the verifier here for the stage's duration, as generate does
    from eagle3_train.serving.vllm_server import hidden_states_server

    server = hidden_states_server(ctx.verifier_dir, _extract_layers(ctx, cfg), ctx.run_dir / "hidden-states-transfer",
                                  trust_remote_code=ctx.trust_remote_code, log_path=ctx.run_dir / "vllm-extract.log",
                                  **ctx.serving())
    with server:
        options.update(model=server.model_name, hidden_states_dir=str(server.hidden_states_dir))
        return _extract_summary(extract(ctx.run_dir / "prepared", ctx.verifier, out, **cfg, **kw,
                                        endpoints=[server.base_url], vllm_options=options))


def _states_mode(ctx: RunContext) -> str:
    """offline: extract, then train from disk; online/hybrid: train asks hidden-state servers (no extract stage)."""
    return str(ctx.cfg["train"].get("hidden_states_mode") or "offline")


# How train reaches its servers in online/hybrid mode (not what it learns): left out of the stage's key.
_TRAIN_TRANSPORT = ("endpoint", "served_model", "online_concurrency", "hidden_states_dir", "prefetch")


def _train_values(ctx: RunContext) -> dict[str, Any]:
    rd = ctx.run_dir
    hidden = "" if _states_mode(ctx) == "online" else str(rd / "hidden_states")  # hybrid stores its states there
    return {"prepared": str(rd / "prepared"), "hidden_states": hidden, "vocab": str(rd / "vocab"),
            "out": str(rd / "train"), "verifier": ctx.verifier.name, **ctx.cfg["train"]}


def _train_key(ctx: RunContext, _v: str | None) -> dict[str, Any]:
    # the number of processes is in the key: it sets the optimizer step's batch (grad_accum x world size)
    n = train_processes(ctx.cfg.get("train_processes", "auto"))
    values = {k: v for k, v in _train_values(ctx).items() if k not in _TRAIN_TRANSPORT}
    offline = _states_mode(ctx) == "offline"
    inputs = [ctx.keys["prepare"], ctx.keys["extract"] if offline else "served", ctx.keys["vocab"]]
    return {**values, "inputs": inputs, **({"processes": n} if n > 1 else {}),
            **(_with_serving(ctx) if not offline and not ctx.cfg["train"].get("endpoint") else {})}


def train_processes(setting: int | str) -> int:
    """`train_processes` as a number: auto = the visible CUDA GPUs (1 on a machine without)."""
    if setting == "auto":
        import torch

        return max(1, torch.cuda.device_count()) if torch.cuda.is_available() else 1
    return int(setting)


def under_torchrun(stage: str, args: list[str], processes: int) -> None:
    """`torchrun --standalone --nproc-per-node N -m eagle3_train.cli STAGE ARGS` on this machine (NCCL or gloo among
    the GPUs' processes, gloo on CPU); a failure names the stage and how to resume it."""
    import subprocess
    import sys

    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(processes),
           "-m", "eagle3_train.cli", stage, *args]
    log.info("[%s] %d processes: %s", stage, processes, " ".join(cmd))
    rc = subprocess.run(cmd).returncode
    if rc != 0:
        raise Eagle3InputError(f"the {stage} stage under torchrun ended with exit code {rc} (its output is above); "
                               f"rerun the same command to resume it")


def train_under_torchrun(cfg, processes: int, launch_file: Path) -> dict[str, Any]:
    """The train stage as `torchrun ... train --config FILE` (data parallel on this machine); its result read back
    from the run's training metadata."""
    launch_file.write_text(yaml.safe_dump({"train": cfg.to_dict()}, sort_keys=False))
    under_torchrun("train", ["--config", str(launch_file)], processes)
    meta = read_json(Path(cfg.out) / "training_metadata.json", "training metadata")
    metrics = meta.get("metrics") or {}
    return {"tokens_per_s": (meta.get("run") or {}).get("tokens_per_s"), "step": meta["progress"]["step"],
            "validation": metrics.get("validation"), "best": metrics.get("best"), "final": str(Path(cfg.out) / "final"),
            "world_size": (meta.get("run") or {}).get("world_size")}


def _train_run(ctx: RunContext, _v: str | None) -> Any:
    from eagle3_train.settings.train import TrainConfig
    from eagle3_train.train.metadata import OUTPUT, WRITES, written_by_train
    from eagle3_train.train.trainer import train

    cfg = build_settings(TrainConfig, _train_values(ctx), "config section 'train'")
    out = ctx.run_dir / "train"
    # Resume only a run that was started with these very settings (an interrupted one); a run with other settings
    # (or of unknown origin) is set aside, never continued with the new settings and never deleted.
    if ctx.pipeline._restarts("train", ctx.keys["train"]) and out.exists():
        aside = set_aside(claim_output_dir(out, *OUTPUT, written_by_train, writes=WRITES))
        log.warning("[train] %s holds a run with other settings: moved it to %s, training from the start", out, aside)
    cfg.resume = (out / "checkpoints" / "latest.json").is_file()
    cfg.trust_remote_code = ctx.trust_remote_code  # recorded in the training metadata
    processes = train_processes(ctx.cfg.get("train_processes", "auto"))

    def run() -> dict[str, Any]:
        return train(cfg, ctx.verifier) if processes == 1 else train_under_torchrun(cfg, processes,
                                                                      ctx.run_dir / "train-launch.yaml")
    if _states_mode(ctx) == "offline" or cfg.endpoint:
        r = run()
    else:  # online/hybrid without endpoints: serve the verifier here for the stage's duration
        from eagle3_train.serving.vllm_server import hidden_states_server

        with hidden_states_server(ctx.verifier_dir, cfg.layer_ids, ctx.run_dir / "hidden-states-transfer",
                                  trust_remote_code=ctx.trust_remote_code, log_path=ctx.run_dir / "vllm-train.log",
                                  **ctx.serving()) as server:
            cfg.endpoint, cfg.served_model = [server.base_url], server.model_name
            cfg.hidden_states_dir = str(server.hidden_states_dir)
            r = run()
    return {"tokens_per_s": r["tokens_per_s"], "steps": r["step"], "validation": r["validation"],
            "best": r["best"], "final": r.get("final")}


def _export_run(ctx: RunContext, fmt: str | None) -> Any:
    from eagle3_train.export.exporter import export

    return export(ctx.run_dir / "train", ctx.run_dir / f"export-{fmt}", fmt=fmt, verifier=ctx.verifier,
                  overwrite=True, **_section(ctx, "export", "formats"))


def _export_use(ctx: RunContext, fmt: str | None, result: Any) -> None:
    ctx.summary.setdefault("exports", {})[fmt] = result["out"]
    ctx.summary.setdefault("serve", {})[fmt] = result["serve"]
    if result.get("serve_sglang"):
        ctx.summary.setdefault("serve_sglang", {})[fmt] = result["serve_sglang"]


def _evaluate_key(ctx: RunContext, _v: str | None) -> dict[str, Any]:
    return {**ctx.cfg["evaluate"], "train": ctx.keys["train"], **_with_serving(ctx)}


def _evaluate_run(ctx: RunContext, _v: str | None) -> Any:
    from eagle3_train.evaluate.pipeline_eval import pipeline_evaluate

    return pipeline_evaluate(ctx.summary.get("exports", {}), ctx.verifier_dir, ctx.run_dir / "evaluate",
                             serving=ctx.serving(), trust_remote_code=ctx.trust_remote_code, **ctx.cfg["evaluate"])


def _summarize(key: str) -> Callable[[RunContext, str | None, Any], None]:
    def use(ctx: RunContext, _v: str | None, result: Any) -> None:
        ctx.summary[key] = result
    return use


# The pipeline, in order. Adding a stage (or a backend of one) is one entry here; docs/ARCHITECTURE.md has the table.
STAGES: tuple[Stage, ...] = (
    Stage("generate", "generate", (), "generated/conversations.jsonl", _generate_key, _generate_run,
          use=_generate_use, enabled=lambda ctx: bool(ctx.cfg["generate"].get("enabled"))),
    Stage("prepare", "prepare", ("generate",), "prepared/manifest.json", _prepare_key, _prepare_run,
          use=_summarize("data")),
    Stage("vocab", "vocab", ("prepare",), "vocab/vocab.safetensors",
          lambda ctx, _v: {**ctx.cfg["vocab"], "prepared": ctx.keys["prepare"]}, _vocab_run, use=_summarize("vocab")),
    Stage("extract", "extract", ("prepare",), "hidden_states/manifest.json", _extract_key, _extract_run,
          use=_summarize("extract"), enabled=lambda ctx: _states_mode(ctx) == "offline"),
    Stage("train", "train", ("prepare", "vocab", "extract"), "train/final", _train_key, _train_run,
          use=_summarize("train")),
    Stage("export", "export", ("train",), "export-{variant}/config.json",
          lambda ctx, fmt: {**_section(ctx, "export", "formats"), "format": fmt, "train": ctx.keys["train"]},
          _export_run, use=_export_use, variants=lambda ctx: list(ctx.cfg["export"]["formats"])),
    Stage("evaluate", "evaluate", ("export",), "evaluate/results.json", _evaluate_key, _evaluate_run,
          use=_summarize("evaluate"),
          enabled=lambda ctx: bool(ctx.cfg["evaluate"]["vllm"] or ctx.cfg["evaluate"]["offline"])),
)


def data_sha256(source: str | Path) -> str:
    from eagle3_train.assets.conversations import resolve_source

    return sha256_file(resolve_source(source))


def _counts(manifest: dict[str, Any]) -> dict[str, Any]:
    return {"counts": manifest.get("counts"), "source": manifest.get("source")}


def _vocab_summary(m: dict[str, Any]) -> dict[str, Any]:
    return {k: m.get(k) for k in ("draft_vocab_size", "coverage", "sha256") if k in m} or m


def _extract_summary(m: dict[str, Any]) -> dict[str, Any]:
    return {"counts": m.get("counts"), "throughput": m.get("throughput"), "layer_ids": m.get("layer_ids"),
            "backend": m.get("backend")}


def torch_dtype(name: str) -> Any:
    import torch

    return torch.bfloat16 if name == "float8_e4m3" else getattr(torch, name)


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
            temps = res.get("at_temperature") or {}
            if len(temps) > 1:  # one row per temperature
                rows += [(f"acceptance length: {name}, T {t}", f"{a:.3f}" if a is not None else "-")
                         for t, a in temps.items()]
            else:
                rows.append((f"acceptance length: {name}", f"{res['mean_acceptance_length']:.3f}"))
    for fmt, path in (s.get("exports") or {}).items():
        rows.append((f"exported draft ({fmt})", path))
    for fmt, cmd in (s.get("serve") or {}).items():
        rows.append((f"serve with vLLM ({fmt})", cmd))
    for fmt, cmd in (s.get("serve_sglang") or {}).items():
        rows.append((f"serve with SGLang ({fmt})", cmd))
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
