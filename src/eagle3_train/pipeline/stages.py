"""The pipeline's stages, one `Stage` entry each, in order: the adapters between a run config and each stage's
Python function (its key, its call, what its result adds to the summary). Adding a stage (or a backend of one) is
one entry in `STAGES`; docs/ARCHITECTURE.md has the table."""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml

from eagle3_train.assets.data_spec import DataSource
from eagle3_train.assets.hub_datasets import NotFetched
from eagle3_train.hidden_states.backends import backend_of
from eagle3_train.pipeline.context import (
    BadSetting,
    RunContext,
    Stage,
    StageRefused,
    aux_convention,
    section,
    states_mode,
    with_serving,
)
from eagle3_train.pipeline.summary import counts, data_sha256, extract_summary, vocab_summary
from eagle3_train.pipeline.torchrun import train_processes, train_under_torchrun, under_torchrun
from eagle3_train.settings import PrepareSettings
from eagle3_train.utils.io import Eagle3InputError, read_json
from eagle3_train.utils.outputs import claim_output_dir, set_aside
from eagle3_train.utils.settings import (
    build_settings,
)

log = logging.getLogger(__name__)


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
                          optimizer=tr.get("optimizer") or TrainConfig.optimizer,
                          finetune_from=tr.get("finetune_from"),
                          source_aux_convention=aux_convention(ctx),
                          gpu_memory_gb=None if gpu_bytes is None else gpu_bytes / 1e9))
    share = p.modes["online"]["server_memory_per_gpu"]
    floor = share.get("at_least_bytes")
    what = (f"the server's weights {floor / 1e9:.1f} GB per GPU over {gpus} beside the trainer's planned peak "
            f"{p.memory['peak'] / 1e9:.1f} GB" if floor else "the server's weight size is unknown (config only)")
    if p.modes["online"]["fits"] is False:
        raise Eagle3InputError(f"train.hidden_states_mode {states_mode(ctx).name} starts the verifier's server on the "
                               f"training GPUs: {what} exceed one GPU's {gpu_bytes / 1e9:.1f} GB. Run the servers on "
                               f"other GPUs and give train.endpoint, or train offline (extract first)")
    if gpu_bytes is None:
        return f"  NOT checked: {what} against GPU memory (no GPU here)"
    return f"  train: {what} fit one GPU's {gpu_bytes / 1e9:.1f} GB (before the server's KV cache)"


def _data_key(ctx: RunContext, source: DataSource, stage: str) -> str:
    """The SHA-256 of the data `stage` reads (in a dry run: from the data cache alone). Where that is the config's
    own data, a problem with it (a mistyped preset, a malformed spec, a missing file) is the config's, named by its
    setting; data an earlier stage writes (generate's output) may simply not be there yet in a dry run."""
    try:
        return data_sha256(source, cached_only=ctx.dry_run)
    except NotFetched:
        raise  # not an error: what a first run fetches (the dry run says so)
    except Eagle3InputError as e:
        if source != ctx.cfg["prepare"]["data"]:
            raise
        raise BadSetting(f"prepare.data (read by the {stage} stage): {e}") from None


# generate: regenerate the assistant turns with the verifier served by vLLM (on-policy data).
_GENERATE_PIPELINE_ONLY = ("enabled", "allow_fallback", "original_answers")  # how the run uses generate's output


def _generate_key(ctx: RunContext, _v: str | None) -> dict[str, Any]:
    source = ctx.cfg["prepare"]["data"]
    return {"data": source, "data_sha256": _data_key(ctx, source, "generate"), "verifier": ctx.verifier_key,
            **section(ctx, "generate", *_GENERATE_PIPELINE_ONLY), **with_serving(ctx)}


def _generate_run(ctx: RunContext, _v: str | None) -> Any:
    from eagle3_train.generate.pipeline_step import run_generation_for_pipeline

    return run_generation_for_pipeline(ctx.cfg["prepare"]["data"], ctx.verifier_dir, ctx.run_dir / "generated",
                                       section(ctx, "generate", *_GENERATE_PIPELINE_ONLY), ctx.serving(),
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
            if ctx.dry_run:  # the file the last run mixed stands for the one this run would write (nothing written)
                ctx.data_source = str(mixed)
                return
            result = {**result, "mix": mix_with_originals(
                ctx.cfg["prepare"]["data"], Path(ctx.data_source), mixed, ctx.cfg["prepare"].get("limit"),
                bool(ctx.cfg["prepare"].get("skip_bad_records")))}
            ctx.data_source = str(mixed)
    ctx.summary["generate"] = result


# prepare: tokenize with the verifier's chat template and the loss mask.
def _prepare_key(ctx: RunContext, _v: str | None) -> dict[str, Any]:
    return {"data": str(ctx.data_source), "data_sha256": _data_key(ctx, ctx.data_source, "prepare"),
            "verifier": ctx.verifier_key, **section(ctx, "prepare", "data")}


def _prepare_run(ctx: RunContext, _v: str | None) -> Any:
    from eagle3_train.data.prepare import prepare

    return counts(prepare(ctx.data_source, ctx.verifier, ctx.run_dir / "prepared", **section(ctx, "prepare", "data"),
                           trust_remote_code=ctx.trust_remote_code, overwrite=True))  # the run's own, redone on change


def _vocab_run(ctx: RunContext, _v: str | None) -> Any:
    from eagle3_train.vocab.build import build_vocab

    return vocab_summary(build_vocab(ctx.run_dir / "prepared", ctx.run_dir / "vocab", overwrite=True,
                                      **ctx.cfg["vocab"]))


# How extract reaches its servers (not what it stores): left out of the stage's key.
_EXTRACT_TRANSPORT = ("endpoint", "model", "concurrency", "hidden_states_dir")


def _extract_section(ctx: RunContext) -> dict[str, Any]:
    """extract's settings; an unset compute_dtype follows `serving.dtype`, so that the HF teacher runs as the
    pipeline's servers (the judge) do."""
    cfg = section(ctx, "extract", *_EXTRACT_TRANSPORT)
    if cfg.get("compute_dtype") is None and ctx.serving().get("dtype") not in (None, "auto"):
        cfg["compute_dtype"] = ctx.serving()["dtype"]
    return cfg


def _extract_key(ctx: RunContext, _v: str | None) -> dict[str, Any]:
    key = {**_extract_section(ctx), "prepared": ctx.keys["prepare"],
           "verifier": ctx.verifier_key, "layers_of": ctx.cfg["train"].get("finetune_from")}
    if aux_convention(ctx) != "auto":  # the user's reading of the source's ids
        key["layers_convention"] = aux_convention(ctx)
    return key | ({} if backend_of(ctx.cfg["extract"].get("backend") or "hf").runs_verifier_here else with_serving(ctx))


def extract_layers(ctx: RunContext, cfg: dict[str, Any]) -> Any:
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
    cfg = _extract_section(ctx)
    # A finetune trains on its source's layers: extract those (as `extract --finetune-from` does), not the default
    # ones the train stage would refuse after the whole extraction.
    cfg["finetune_from"] = ctx.cfg["train"].get("finetune_from")
    cfg["source_aux_convention"] = aux_convention(ctx)
    out = ctx.run_dir / "hidden_states"
    kw = dict(trust_remote_code=ctx.trust_remote_code, overwrite=restart)
    ext = ctx.cfg["extract"]
    if backend_of(cfg.get("backend") or "hf").runs_verifier_here:
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
            return extract_summary(read_json(out / "manifest.json", "hidden-states manifest"))
        return extract_summary(extract(ctx.run_dir / "prepared", ctx.verifier, out, **cfg, **kw))
    options = {k: ext[k] for k in ("model", "concurrency", "hidden_states_dir") if ext.get(k) is not None}
    if ext.get("endpoint"):  # the user's servers (a multi-GPU verifier): their storage dir is given
        return extract_summary(extract(ctx.run_dir / "prepared", ctx.verifier, out, **cfg, **kw,
                                        endpoints=ext["endpoint"], vllm_options=options))
    # no endpoint: serve the verifier here for the stage's duration, as generate does
    from eagle3_train.serving.vllm_server import hidden_states_server

    server = hidden_states_server(ctx.verifier_dir, extract_layers(ctx, cfg), ctx.run_dir / "hidden-states-transfer",
                                  trust_remote_code=ctx.trust_remote_code, log_path=ctx.run_dir / "vllm-extract.log",
                                  **ctx.serving())
    with server:
        options.update(model=server.model_name, hidden_states_dir=str(server.hidden_states_dir))
        return extract_summary(extract(ctx.run_dir / "prepared", ctx.verifier, out, **cfg, **kw,
                                        endpoints=[server.base_url], vllm_options=options))


# How train reaches its servers in online/hybrid mode, and where it reports its metrics (not what it learns): left
# out of the stage's key, so turning a tracker on does not train a finished run again.
_TRAIN_TRANSPORT = ("endpoint", "served_model", "online_concurrency", "hidden_states_dir", "prefetch", "report_to",
                    "tensorboard")


def train_values(ctx: RunContext) -> dict[str, Any]:
    rd = ctx.run_dir
    hidden = str(rd / "hidden_states") if states_mode(ctx).on_disk else ""  # hybrid stores its states there
    return {"prepared": str(rd / "prepared"), "hidden_states": hidden, "vocab": str(rd / "vocab"),
            "out": str(rd / "train"), "verifier": ctx.verifier.name, **ctx.cfg["train"]}


def _train_key(ctx: RunContext, _v: str | None) -> dict[str, Any]:
    # the number of processes is in the key: it sets the optimizer step's batch (grad_accum x world size)
    n = train_processes(ctx.cfg.get("train_processes", "auto"))
    values = {k: v for k, v in train_values(ctx).items() if k not in _TRAIN_TRANSPORT}
    offline = states_mode(ctx).reads_stored
    inputs = [ctx.keys["prepare"], ctx.keys["extract"] if offline else "served", ctx.keys["vocab"]]
    return {**values, "inputs": inputs, **({"processes": n} if n > 1 else {}),
            **(with_serving(ctx) if not offline and not ctx.cfg["train"].get("endpoint") else {})}


def _train_run(ctx: RunContext, _v: str | None) -> Any:
    from eagle3_train.settings.train import TrainConfig
    from eagle3_train.train.metadata import OUTPUT, WRITES, written_by_train
    from eagle3_train.train.trainer import train

    cfg = build_settings(TrainConfig, train_values(ctx), "config section 'train'")
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
    if not states_mode(ctx).served or cfg.endpoint:
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


def _select_key(ctx: RunContext, _v: str | None) -> dict[str, Any]:
    from eagle3_train.evaluate.select import resolve_by

    # auto: served when the run is judged by vLLM (evaluate.vllm), so the key holds the outcome
    by = resolve_by(ctx.cfg["select"]["by"], ctx.cfg["evaluate"]["vllm"])
    k = ctx.cfg["select"].get("k") or ctx.cfg["export"]["speculative_tokens"]  # serve it as export will
    return {**ctx.cfg["select"], "by": by, "k": k, "train": ctx.keys["train"],
            **(with_serving(ctx) if by == "served" else {})}


def _select_run(ctx: RunContext, _v: str | None) -> Any:
    from eagle3_train.evaluate.select import select_checkpoint

    settings = {k: ctx.keys["select"][k] for k in (*ctx.cfg["select"], "k")}  # `by` and `k` as the key holds them
    return select_checkpoint(ctx.run_dir / "train", ctx.verifier_dir, ctx.run_dir / "prepared",
                             ctx.run_dir / "select", serving=ctx.serving(),
                             trust_remote_code=ctx.trust_remote_code, **settings)


def _select_use(ctx: RunContext, _v: str | None, result: Any) -> None:
    ctx.summary["select"] = {k: result[k] for k in ("by", "selected", "selected_step", "last_step")}
    ctx.summary["select"]["candidates"] = [{k: c[k] for k in ("name", "step", "estimate", "served")}
                                           for c in result["candidates"]]


def _export_run(ctx: RunContext, fmt: str | None) -> Any:
    from eagle3_train.export.exporter import export

    source = (ctx.summary.get("select") or {}).get("selected") or ctx.run_dir / "train"
    return export(source, ctx.run_dir / f"export-{fmt}", fmt=fmt, verifier=ctx.verifier,
                  overwrite=True, **section(ctx, "export", "formats"))


def _export_formats(ctx: RunContext) -> list[str]:
    """export.formats, less the speculators format for a method it cannot carry (DFlash: said in the log)."""
    from eagle3_train.model.draft_methods import draft_method

    method = draft_method(ctx.cfg["train"].get("method") or "eagle3")
    formats = list(ctx.cfg["export"]["formats"])
    if method.speculators_refusal and "speculators" in formats:
        log.warning("export: no speculators format for a %s draft: %s", method.name, method.speculators_refusal)
        formats.remove("speculators")
    return formats


def _export_use(ctx: RunContext, fmt: str | None, result: Any) -> None:
    ctx.summary.setdefault("exports", {})[fmt] = result["out"]
    ctx.summary.setdefault("serve", {})[fmt] = result["serve"]
    if result.get("serve_sglang"):
        ctx.summary.setdefault("serve_sglang", {})[fmt] = result["serve_sglang"]


def _evaluate_key(ctx: RunContext, _v: str | None) -> dict[str, Any]:
    return {**ctx.cfg["evaluate"], "train": ctx.keys["train"], **with_serving(ctx)}


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
          use=_summarize("extract"), enabled=lambda ctx: states_mode(ctx).reads_stored),
    Stage("train", "train", ("prepare", "vocab", "extract"), "train/final", _train_key, _train_run,
          use=_summarize("train")),
    Stage("select", "select", ("train",), "select/selection.json", _select_key, _select_run, use=_select_use),
    Stage("export", "export", ("train", "select"), "export-{variant}/config.json",
          lambda ctx, fmt: {**section(ctx, "export", "formats"), "format": fmt, "train": ctx.keys["train"],
                            "select": ctx.keys["select"]},
          _export_run, use=_export_use, variants=_export_formats),
    Stage("evaluate", "evaluate", ("export",), "evaluate/results.json", _evaluate_key, _evaluate_run,
          use=_summarize("evaluate"),
          enabled=lambda ctx: bool(ctx.cfg["evaluate"]["vllm"] or ctx.cfg["evaluate"]["offline"])),
)
