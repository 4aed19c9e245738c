"""The runner: checks a run before it starts, then loops over `stages.STAGES`, skipping each stage whose key, output
and inputs are unchanged, recording the rest (`pipeline_state.json`), and ends with the summary; `dry_run` prints
what a run would do."""

from __future__ import annotations

import logging
import time
from functools import partial
from pathlib import Path
from typing import Any

from eagle3_train.assets.hub_datasets import NotFetched
from eagle3_train.hidden_states.backends import backend_of
from eagle3_train.pipeline.config import merged_config
from eagle3_train.pipeline.context import (
    BadSetting,
    RunContext,
    Stage,
    StageRefused,
    aux_convention,
    check_local_server,
    states_mode,
)
from eagle3_train.pipeline.stages import STAGES, extract_layers, served_beside_training, train_values
from eagle3_train.pipeline.summary import format_summary, torch_dtype
from eagle3_train.settings import ExtractSettings, PrepareSettings
from eagle3_train.utils.io import Eagle3InputError, read_json, sha256_json, write_json
from eagle3_train.utils.outputs import claimed_output, has_file, own
from eagle3_train.utils.provenance import environment, now_iso
from eagle3_train.utils.settings import (
    build_settings,
)

log = logging.getLogger(__name__)


def _finetune_source_checks(ctx: RunContext) -> list[str]:
    """A finetune source read (headers only) and fitted to the verifier before anything runs; the layers extract
    will tap are its own."""
    source = ctx.cfg["train"].get("finetune_from")
    if not source:
        return []
    from eagle3_train.checkpoints.fit import check_draft_fits_verifier, verifier_dims
    from eagle3_train.checkpoints.formats import fill_default_aux_ids, load_draft_source

    convention = aux_convention(ctx)
    loaded = load_draft_source(source, shapes_only=True, aux_convention=convention)
    fill_default_aux_ids(loaded.config, verifier_dims(ctx.verifier.config)[2])
    check_draft_fits_verifier(loaded.config, ctx.verifier.config, f"train.finetune_from {source}", ctx.verifier.name,
                              {**loaded.tensors, **loaded.extra}, loaded.source_name)
    layers = extract_layers(ctx, {**ctx.cfg["extract"], "finetune_from": source,
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

    def _context(self, need: str = "weights", dry_run: bool = False) -> RunContext:
        from eagle3_train.assets.verifier import Verifier

        verifier = Verifier.resolve(self.cfg["verifier"], need)  # once for every stage; manifests record its name
        # Stages are keyed on what they read, not on names: a verifier or data file changed in place reruns them.
        self.verifier_key = verifier.stage_key()
        return RunContext(cfg=self.cfg, run_dir=self.run_dir, verifier=verifier, verifier_dir=verifier.path,
                          verifier_key=self.verifier_key, pipeline=self, data_source=self.cfg["prepare"]["data"],
                          summary=self.summary, dry_run=dry_run)

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
        print(format_summary(self.summary, rd / "summary.json"))
        return self.summary

    def dry_run(self) -> dict[str, Any]:
        """Validate the config and print the plan: which stages are done and which would run (and why); when
        prepare, vocab and extract have outputs, run `train --dry-run` on them (nothing else is written)."""
        from eagle3_train.settings.train import TrainConfig
        from eagle3_train.train.dry_run import dry_run, format_report

        # a hub verifier's weights are not downloaded to check a config, nor a dataset to compute a stage's key
        ctx = self._context(need="tokenizer", dry_run=True)
        train_cfg = build_settings(TrainConfig, {**train_values(ctx), "trust_remote_code": ctx.trust_remote_code},
                                   "config section 'train'")
        _check_stage_settings(ctx, train_cfg)
        steps = self.plan(ctx)
        lines = [f"run --dry-run: config valid, verifier {ctx.verifier_dir}"]
        lines += [f"  {name}: {status} -> {where}" for name, (status, where) in steps.items()]
        lines += self._server_checks(ctx)
        lines += _finetune_source_checks(ctx)
        plan = {name: status for name, (status, _) in steps.items()}
        needed = ("prepare", "vocab", "extract") if states_mode(ctx).reads_stored else ("prepare", "vocab")
        done = {name: plan[name].startswith("done") for name in needed}
        report: dict[str, Any] = {"stages_done": done, "plan": plan}
        served_here = states_mode(ctx).served and not ctx.cfg["train"].get("endpoint")
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
        mode = states_mode(ctx)
        if mode.served:
            if tr.get("endpoint"):
                return [f"  train: {mode.name} mode, states from the servers {tr['endpoint']} (the train dry run asks "
                        f"them)"]
            check_local_server(f"train.hidden_states_mode is {mode.name}")
            return [f"  train: {mode.name} mode, states from a vLLM hidden-state server the run starts here",
                    served_beside_training(ctx)]
        if backend_of(ext.get("backend") or "hf").runs_verifier_here:
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
        check_local_server("extract.backend is vllm")
        return ["  extract: states from a vLLM hidden-state server the run starts here (serving section)"]

    def plan(self, ctx: RunContext | None = None) -> dict[str, tuple[str, str]]:
        """{stage instance: (what `run` would do with it, its output under run_dir)}, computed as `run` decides but
        running, fetching and writing nothing (`ctx`: a dry-run context)."""
        ctx = ctx or self._context(dry_run=True)
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
        unfetched = None  # what the run would fetch before it can compute the key
        try:
            key = ctx.keys[name] = st.key(ctx, variant)
        except NotFetched as e:  # a dataset (or mixture) the data cache lacks: its SHA-256 is known once the run
            key = ctx.keys[name] = None  # fetched (or wrote) it
            unfetched = str(e)
        except BadSetting:
            raise  # the config names data that is not there: the run would stop on it, so the dry run does
        except (Eagle3InputError, OSError) as e:  # e.g. data that an earlier stage has yet to write
            key = ctx.keys[name] = None
            log.debug("[%s] key not computable yet: %s", name, e)
        rec, output = self.state["stages"].get(name), st.output(ctx, variant)
        if rec is None or not output.exists():
            return f"would run ({unfetched})" if unfetched else "would run"
        reads = self._reads(ctx, st)
        first = [r for r in reads if plan.get(r, "").startswith(("would run", "done, but"))]
        if unfetched and not first:  # the same data fetched again keeps it done; other data runs it again
            return f"done, but may run again ({unfetched})"
        if key is None or first or not self._done(name, key, output, reads):
            why = f"{', '.join(first)} run(s) first" if first else "its settings or what it reads changed"
            return f"done, but would run again ({why})"
        try:
            st.use(ctx, variant, rec.get("result"))
        except Eagle3InputError as e:
            return f"would run ({e})"
        return "done (skipped)"
