"""The settings of every stage, one dataclass each: the single place where a setting's default and meaning live.

Each dataclass is a YAML section of `eagle3-train run` (fields with `yaml=False` are paths the pipeline fills in),
the flags of the stage's command (`utils.settings.add_settings_arguments`), and the keyword defaults of the stage's
Python function. docs/CONFIG.md is generated from here (`python -m eagle3_train.settings --markdown`).
`train`'s settings are `settings/train.py` (TrainConfig), `plan`'s `settings/plan.py` (PlanSettings); the package
imports nothing heavy and no stage, so every stage and the orchestrators may read it.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar, Literal

from eagle3_train.assets.thinking import ThinkingStyleName
from eagle3_train.assets.verifier import DEFAULT_VERIFIER
from eagle3_train.settings.common import (
    CONCURRENCY,
    CONTEXT_HELP,
    EXTRACT_GPU_MEMORY_UTILIZATION,
    K_FLAGS,
    MAX_TOKENS,
    NUM_SPECULATIVE_TOKENS,
    SERVER_DTYPE_CHOICES,
    SERVER_EAGER_HELP,
    TRUST_HELP,
    VERIFIER_HELP,
    VLLM_ARGS_HELP,
    Dtype,
    Engine,
    ExportFormat,
    ExtractBackend,
    Overflow,
    Reasoning,
    ReasoningPlacement,
    ServerDtype,
    StoreDtype,
)
from eagle3_train.settings.plan import PlanSettings
from eagle3_train.settings.train import AUX_CONVENTION_HELP, HS_DIR_HELP, AuxConvention, TrainConfig
from eagle3_train.utils.outputs import OUTPUT_WRITERS
from eagle3_train.utils.settings import markdown_table, setting


@dataclass
class RunSettings:
    """Top-level keys of a run config."""

    SECTION: ClassVar[str] = "run"
    run_dir: str = setting("runs/default", "directory of the whole run (every stage's output, summary.json)")
    verifier: str = setting(DEFAULT_VERIFIER, VERIFIER_HELP)
    trust_remote_code: bool = setting(False, TRUST_HELP + " (prepare, extract, the vLLM servers)")
    train_processes: int | Literal["auto"] = setting(
        "auto", "processes of the train stage (data parallel) and of an HF extract stage (a verifier replica each, "
                "disjoint shards): auto = one per visible CUDA GPU (1 without); N > 1 runs them as `torchrun "
                "--standalone --nproc-per-node N` (multi-node: run `torchrun ... eagle3-train train` yourself, "
                "docs/GUIDE.md)", cli=False, valid=">= 1")
    dry_run: bool = setting(False, "validate the config; with prepare/vocab/extract done, run `train --dry-run` on "
                                   "their outputs", yaml=False)


@dataclass
class PrepareSettings:
    SECTION: ClassVar[str] = "prepare"
    data: list[str] = setting(
        default_factory=lambda: ["sharegpt"], commas=False, metavar="SOURCE",
        help="conversations: 'sharegpt' (embedded), a preset (docs/DATA.md), a Hub dataset "
             "ORG/NAME[:CONFIG][@SPLIT][:N], a dataset dir, a ShareGPT/OpenAI-messages .json/.jsonl file, or a "
             "`generate` output dir; repeat to mix sources, weighted or not (docs/DATA.md)")
    verifier: str = setting("", VERIFIER_HELP + " (its tokenizer and chat template)", required=True, yaml=False)
    out: str = setting("", "output directory (dataset/ and manifest.json)", required=True, yaml=False)
    max_length: int = setting(2048, "tokens per sample", valid=">= 1")
    overflow: Overflow = setting("truncate", "samples longer than max_length: truncate them, or drop them")
    limit: int | None = setting(None, "read only the first N conversations of the source", metavar="N", valid=">= 1")
    val_fraction: float = setting(0.05, "share of conversations held out for validation", valid="[0, 1)")
    val_count: int | None = setting(None, "exact number of validation conversations (overrides val_fraction)",
                                    valid=">= 0")
    seed: int = setting(0, "seed of the train/validation split")
    chat_template: str | None = setting(None, "a .jinja file (or template text) used instead of the tokenizer's "
                                              "chat template")
    leading_assistant: Literal["trim", "skip"] = setting(
        "trim", "conversations starting with an assistant turn: drop those turns, or skip the conversation")
    reasoning: ReasoningPlacement = setting(
        "auto", "a thinking model's reasoning_content: through the chat template, inline in <think> tags, dropped, "
                "or auto (template when it renders reasoning, else inline); supervised like the answer")
    supervise_kept_turns: bool = setting(
        False, "regenerated data: also supervise the assistant turns `generate` kept as given (tool calls answered by "
               "recorded results), which the verifier did not produce")
    trust_remote_code: bool = setting(False, TRUST_HELP, yaml=False)
    skip_bad_records: bool = setting(False, "skip source records that are not valid JSON/UTF-8 or not conversations "
                                            "(counted by reason in the manifest, the first named) instead of stopping "
                                            "at the first")
    preview: int = setting(0, "print N samples with the supervised tokens highlighted", yaml=False, metavar="N",
                           valid=">= 0")
    overwrite: bool = setting(False, "replace an earlier prepared output in --out made from other data, another "
                                     "verifier or other settings", yaml=False)


@dataclass
class GenerateSettings:
    SECTION: ClassVar[str] = "generate"
    enabled: bool = setting(False, "regenerate the assistant turns with the verifier before `prepare` (on-policy "
                                   "data; the run fails when the vLLM env is missing, unless allow_fallback)",
                            cli=False)
    allow_fallback: bool = setting(False, "train on the original answers when generation cannot run (no vLLM env)",
                                   cli=False)
    original_answers: bool = setting(False, "also train on the original answers of the conversations that were not "
                                            "regenerated (past generate.limit or skipped by it, up to prepare.limit): "
                                            "on-policy data where generated, more data at no generation cost",
                                     cli=False)
    data: list[str] = setting(
        default_factory=lambda: ["sharegpt"], required=True, yaml=False, commas=False, metavar="SOURCE",
        help="conversations: 'sharegpt', a preset (docs/DATA.md), a Hub dataset ORG/NAME[:CONFIG][@SPLIT][:N], a "
             "dataset dir, a .json/.jsonl file or a data dir; repeat to mix sources, weighted or not (docs/DATA.md)")
    out: str = setting("", "output directory (conversations.jsonl, manifest.json)", required=True, yaml=False)
    endpoint: list[str] = setting(default_factory=list, help="OpenAI-compatible base URL, e.g. "
                                  "http://127.0.0.1:8000/v1 (repeat to spread the load)", yaml=False)
    model: str | None = setting(None, "served model name (default: the only model the endpoint serves)",
                                yaml=False)
    limit: int | None = setting(None, "use the first N conversations of the source", metavar="N", valid=">= 1")
    max_turns: int | None = setting(None, "keep the first N user turns of each conversation (each turn costs "
                                          "another generation)", cli=False, valid=">= 1")
    concurrency: int | None = setting(
        None, "conversations in flight over all endpoints (default: what each vLLM server's KV cache holds at "
              "max_tokens per request, at most 256 each; 8 per endpoint that does not say)", valid=">= 1")
    max_tokens: int | None = setting(
        None, "max new tokens per assistant turn (default: 512; with thinking on a thinking model, half the server's "
              "max_model_len up to 32768, else 16384: a cut reasoning is a cut turn)", valid=">= 1")
    truncated_turns: Literal["keep", "drop"] = setting(
        "keep", "a turn cut at max_tokens ends its conversation: keep what was generated (on-policy tokens) or drop "
                "the conversation (to skipped.jsonl); counted in the manifest either way")
    temperature: float = setting(0.0, "sampling temperature (the manifest records the family's recommended one)",
                                 valid=">= 0")
    top_p: float = setting(1.0, "nucleus sampling threshold", valid="(0, 1]")
    seed: int | None = setting(None, "base seed; each request gets one derived from (seed, id, turn)")
    reasoning: Reasoning = setting("keep", "reasoning text: keep as reasoning_content, strip it, or disable thinking "
                                           "(the request that does it is the thinking style's)")
    thinking_style: ThinkingStyleName = setting(
        "auto", "how the verifier's thinking is switched and what sampling its makers recommend (docs/KIMI.md, "
                "'Thinking'); auto: from the chat template of a local model, else from the served model's name")
    estimate_only: bool = setting(False, "regenerate the first wave of conversations (one per request in flight), "
                                         "print the measured ETA of the rest (on the long side: the wave also warms "
                                         "the server) and stop; a rerun resumes", yaml=False)
    timeout_s: float = setting(600.0, "per-request timeout in seconds", flag="--timeout", aliases=("--timeout-s",),
                               valid="> 0")
    max_retries: int = setting(6, "retries on connection errors, 429 and 5xx", valid=">= 0")
    api_key: str | None = setting(None, "API key of the endpoints (default: $OPENAI_API_KEY, else EMPTY)",
                                  yaml=False)
    overwrite: bool = setting(False, "discard an existing output in --out and start over (without it a rerun "
                                     "resumes, and output made with other settings is refused)", yaml=False)
    skip_bad_records: bool = setting(False, "skip source records that are not valid JSON/UTF-8 or not conversations "
                                            "(counted by reason in the manifest, the first named) instead of stopping "
                                            "at the first")
    serve_verifier: str | None = setting(None, "start a vLLM server for this verifier (e.g. smollm2-135m-instruct) "
                                               "and use it", yaml=False, metavar="NAME_OR_DIR")
    max_model_len: int | None = setting(None, CONTEXT_HELP + "; in a run config: serving.max_model_len",
                                        flag="--serve-max-model-len", aliases=("--max-model-len",), valid=">= 1")
    serve_enforce_eager: bool | Literal["auto"] = setting("auto", SERVER_EAGER_HELP + "on CPU only)", yaml=False)
    vllm_args: list[str] = setting(default_factory=list, help=VLLM_ARGS_HELP + " (--serve-verifier; in a run "
                                   "config: serving.vllm_args)", flag="--vllm-arg", aliases=("--vllm-args",),
                                   commas=False, yaml=False)


@dataclass
class VocabSettings:
    SECTION: ClassVar[str] = "vocab"
    prepared: str = setting("", "output directory of `eagle3-train prepare`", required=True, yaml=False)
    out: str = setting("", "output directory (vocab.safetensors and manifest.json)", required=True, yaml=False)
    size: int = setting(32000, "draft vocabulary size (clipped to the verifier's vocabulary)", valid=">= 1")
    overwrite: bool = setting(False, "replace a vocabulary in --out that was built from other data or another size",
                              yaml=False)


@dataclass
class ExtractSettings:
    SECTION: ClassVar[str] = "extract"
    prepared: str = setting("", "output directory of `eagle3-train prepare`", required=True, yaml=False)
    verifier: str | None = setting(None, VERIFIER_HELP + " (default: the one the prepared data was tokenized with)",
                                   yaml=False)
    out: str = setting("", "directory for the hidden-state shards (rerun to resume)", required=True, yaml=False)
    layer_ids: str | list[int] | None = setting(
        None, "three aux layers as 'low,mid,high' (input of layer i = HF hidden_states[i]); default 2,L//2,L-3")
    finetune_from: str | None = setting(None, "the draft you will finetune (dir, export or hub id): extract the layers "
                                              "it was trained on (read in its producer's convention)", yaml=False)
    source_aux_convention: AuxConvention = setting("auto", AUX_CONVENTION_HELP, yaml=False)
    dtype: StoreDtype = setting("bfloat16", "storage dtype of the hidden states; float8_e4m3: half the bytes of "
                                            "bfloat16, one float32 scale per token and layer (read back as bfloat16)",
                                flag="--store-dtype", aliases=("--dtype",))
    compute_dtype: ServerDtype | None = setting(None, "dtype the verifier runs in (default: the dtype the vLLM servers "
                                                      "started here serve it in, so that the stored teacher is the "
                                                      "judge; " + SERVER_DTYPE_CHOICES + ")")
    token_budget: int = setting(8192, "max padded tokens (batch x longest) per forward pass", valid=">= 1")
    shard_tokens: int | None = setting(None, "tokens per shard file (default: about 256 MiB per shard)", valid=">= 1")
    device: str = setting("auto", "auto (cuda if available), cpu or cuda[:N]")
    splits: list[str] = setting(default_factory=lambda: ["train", "validation"],
                                help="splits to extract (comma-separated or repeated)", aliases=("--split",))
    max_samples: int | None = setting(None, "only the first N samples of each split", valid=">= 1")
    overwrite: bool = setting(False, "replace hidden states in --out that were made with other settings",
                              yaml=False)
    hash_weights: bool = setting(False, "record the SHA-256 of every verifier weight file in the manifest (reads "
                                        "all weights: ~1 TB for Kimi-K2); default: config, weight index and file "
                                        "sizes identify the verifier")
    backend: ExtractBackend = setting("hf", "hf: run the verifier here; vllm: ask hidden-state servers (--endpoint, "
                                            "`eagle3-train serve --extract-hidden-states`; in a run config without "
                                            "endpoints the pipeline starts one with the serving section)")
    endpoint: list[str] = setting(default_factory=list, help="hidden-state server URL ending in /v1 (repeat for "
                                  "several servers); --backend vllm")
    model: str | None = setting(None, "served model name (default: the only model the first endpoint serves)")
    concurrency: int = setting(CONCURRENCY, "requests in flight over all endpoints (--backend vllm)", valid=">= 1")
    hidden_states_dir: str | None = setting(None, HS_DIR_HELP + " (--backend vllm)")
    trust_remote_code: bool = setting(False, TRUST_HELP, yaml=False)


@dataclass
class SelectSettings:
    """The pipeline's select stage (evaluate/select.py): which of the training run's checkpoints export ships."""

    SECTION: ClassVar[str] = "select"
    by: Literal["auto", "served", "estimate", "final"] = setting(
        "auto", "served: the kept checkpoint vLLM accepts most from on the validation split's first user turns "
                "(each candidate exported and served); estimate: the training estimate on the validation split "
                "(train's best/); final: the last weights; auto: served when the run's evaluate stage uses vLLM, else "
                "estimate")
    max_candidates: int = setting(3, "checkpoints served (the best by estimate; each is a server start)",
                                  valid=">= 1")
    num_prompts: int = setting(40, "validation-split prompts each candidate is served", valid=">= 1")
    max_tokens: int = setting(64, "new tokens per prompt", valid=">= 1")
    k: int | None = setting(None, "draft tokens per speculation round (default: export.speculative_tokens)",
                            valid=">= 1")


@dataclass
class ExportSettings:
    SECTION: ClassVar[str] = "export"
    checkpoint: str = setting("", "training run dir (uses final/) or a checkpoint dir", positional=True, yaml=False)
    out: str = setting("", "output directory of the exported draft", required=True, yaml=False)
    formats: list[ExportFormat] = setting(default_factory=lambda: ["eagle"], help="formats the pipeline exports "
                                          "(one directory export-FORMAT each)", cli=False)
    format: ExportFormat = setting("eagle", "eagle (vLLM/SGLang EAGLE-3 config) or speculators (self-describing, "
                                            "`vllm serve DRAFT`)", yaml=False)
    dtype: Dtype = setting("bfloat16", "dtype of the exported weights", flag="--weight-dtype", aliases=("--dtype",))
    speculative_tokens: int = setting(NUM_SPECULATIVE_TOKENS, "draft tokens per round recorded in the export and "
                                                              "its serve command", **K_FLAGS, valid=">= 1")
    verifier: str | None = setting(None, "verifier name/path recorded in a speculators export (default: from the "
                                         "training metadata)", yaml=False)
    include_embed: bool = setting(False, "also store the verifier's embedding in the export")
    engine: Engine | None = setting(
        None, "refuse to export a draft this engine would serve differently from how it was trained", flag="--for")
    overwrite: bool = setting(False, "replace an existing export in --out made from another checkpoint or with "
                                     "other settings", yaml=False)


@dataclass
class AdoptSettings:
    directory: str = setting("", "an output directory with no listing marker (an earlier version's output, or a "
                                 "copy made without its dot files)", positional=True, yaml=False)
    output_of: str = setting("", "the stage whose output it is: " + ", ".join(OUTPUT_WRITERS), required=True,
                             flag="--stage")


@dataclass
class LaunchSettings:
    nodes: int = setting(1, "machines in the run", required=True)
    gpus_per_node: int = setting(1, "processes per machine (its GPUs)", required=True)
    head: str = setting("", "the first machine's address, HOST or HOST:PORT (port 29500); it hosts the c10d "
                            "rendezvous", required=True)
    stage_args: list[str] = setting(default_factory=list, help="`-- STAGE FLAGS...`: the stage to run on every "
                                    "machine (train or extract) and its flags", positional=True, yaml=False)
    run_id: str | None = setting(None, "rendezvous id (default: derived from the stage's arguments, so the same on "
                                       "every machine)")
    start: bool = setting(False, "start this machine's torchrun instead of printing the command")


@dataclass
class _PromptSettings:
    """What acceptance is measured on (shared by the evaluate modes)."""

    benchmark: str = setting("mt-bench", "mt-bench, humaneval, or a .jsonl/.txt prompt file",
                             aliases=("--prompts",))
    num_prompts: int | None = setting(None, "first N prompts (default all)", aliases=("--limit",), metavar="N",
                                      valid=">= 1")
    turns: Literal[1, 2] | None = setting(None, "turns per prompt (MT-bench has 2; default all)")
    k: int = setting(NUM_SPECULATIVE_TOKENS, "draft tokens per speculation round", **K_FLAGS, valid=">= 1")


@dataclass
class _SamplingSettings:
    """How served prompts are sampled (the offline evaluator is greedy only)."""

    temperature: float = setting(0.0, "sampling temperature of the served requests: 0 measures the argmax match; "
                                      "above 0 vLLM verifies by rejection sampling and outputs are not compared with "
                                      "a baseline", valid=">= 0")
    seed: int = setting(0, "base seed of sampled requests (each request's seed derives from it, prompt and turn)")
    also_temperature: list[float] = setting(
        default_factory=list, help="measure acceptance again at this temperature on the same draft server and "
        "prompts (repeatable; e.g. the family's recommended one beside temperature 0): `at_temperature` in the "
        "results")


@dataclass
class EvaluateSettings(_SamplingSettings, _PromptSettings):
    """The pipeline's evaluate stage."""

    SECTION: ClassVar[str] = "evaluate"
    vllm: bool | Literal["auto"] = setting(False, "measure acceptance on a real vLLM server per export; auto: when "
                                                  "the vLLM env exists")
    offline: bool = setting(False, "also run the offline evaluator (HF verifier in this process)")
    num_prompts: int | None = setting(80, "prompts sent to the vLLM servers", valid=">= 1")
    turns: Literal[1, 2] | None = setting(1, "turns per prompt (MT-bench has 2; null: all)")
    max_tokens: int = setting(MAX_TOKENS, "new tokens per turn", valid=">= 1")
    concurrency: int = setting(CONCURRENCY, "requests in flight", valid=">= 1")
    baseline: bool = setting(False, "also serve the verifier alone: speed-up and greedy-equality check")
    offline_prompts: int = setting(10, "prompts for the offline evaluator (the first of the same set)", valid=">= 0")
    formats: list[ExportFormat] | None = setting(None, "exports served by vLLM (default: every exported format; "
                                                       "both hold the same weights, and tests check that vLLM "
                                                       "accepts the same drafts from each)")


@dataclass
class OfflineEvalSettings(_PromptSettings):
    """`eagle3-train evaluate offline`."""

    SECTION: ClassVar[str] = "evaluate"
    draft: str = setting("", "training run dir, checkpoint dir, or exported draft (EAGLE or speculators format)",
                         required=True)
    verifier: str | None = setting(None, "verifier name or HF dir (default: the one recorded with the draft)")
    max_new_tokens: int = setting(MAX_TOKENS, "new tokens per turn", flag="--max-tokens",
                                  aliases=("--max-new-tokens",), valid=">= 1")
    prepared: str | None = setting(None, "prepared data dir to test the prompts against (default: the draft's "
                                         "training metadata data.prepared)")
    check_greedy: bool = setting(True, "compare token for token with plain greedy decoding (--no-check-greedy is "
                                       "about 2x faster)")
    tie_tol: float = setting(1e-3, "logit gap under which a difference from greedy decoding counts as a near-tie",
                             valid=">= 0")
    device: str = setting("cpu", "torch device")
    dtype: Dtype = setting("float32", "dtype the verifier and the draft compute in", flag="--compute-dtype",
                           aliases=("--dtype",))
    threads: int | None = setting(None, "torch CPU threads (default: torch's choice; 1 is often fastest for small "
                                        "verifiers on a shared CPU)", valid=">= 1")
    out: str | None = setting(None, "output dir: results.json and acceptance_by_position.png")
    trust_remote_code: bool = setting(False, TRUST_HELP)


@dataclass
class ServedEvalSettings(_SamplingSettings, _PromptSettings):
    """`eagle3-train evaluate served`: either --endpoint (running servers with the draft) or --draft (a vLLM server
    is started for --verifier with that draft; --baseline also starts one without it)."""

    SECTION: ClassVar[str] = "evaluate"
    endpoint: list[str] = setting(default_factory=list, help="OpenAI base URL (…/v1) of a running vLLM server with "
                                  "the draft (repeat to spread the prompts over several; counters are summed)")
    model: str | None = setting(None, "served model name (default: the only model served)")
    baseline_endpoint: str | None = setting(None, "base URL of the same verifier served WITHOUT a draft")
    baseline: bool = setting(False, "start a baseline server without the draft too")
    verifier: str | None = setting(None, "verifier name or dir for servers started here (default: the one recorded "
                                         "with --draft)")
    draft: str | None = setting(None, "exported draft dir (EAGLE format) to serve with the verifier")
    enforce_eager: bool | Literal["auto"] = setting("auto", SERVER_EAGER_HELP + "on CPU only)")
    max_model_len: int | None = setting(None, CONTEXT_HELP, valid=">= 1")
    server_dtype: ServerDtype = setting("auto", "dtype of servers started here (" + SERVER_DTYPE_CHOICES + ")")
    vllm_args: list[str] = setting(default_factory=list, help=VLLM_ARGS_HELP, flag="--vllm-arg",
                                   aliases=("--vllm-args",), commas=False)
    max_tokens: int = setting(MAX_TOKENS, "new tokens per turn (a thinking model's answers: thousands)",
                              aliases=("--max-new-tokens",), valid=">= 1")
    concurrency: int = setting(CONCURRENCY, "requests in flight", valid=">= 1")
    reasoning_split: bool | Literal["auto"] = setting(
        "auto", "also measure acceptance inside a thinking model's reasoning and in its answer, a pass each over "
        "the first turns (auto: when `</think>` is one token of the served tokenizer)")
    out: str | None = setting(None, "output dir: results.json and served_completions.jsonl")
    trust_remote_code: bool = setting(False, TRUST_HELP + " (the servers started with --draft)")


@dataclass
class ServeSettings:
    SECTION: ClassVar[str] = "serve"
    verifier: str | None = setting(None, VERIFIER_HELP + " (default: the one recorded with --draft)")
    draft: str | None = setting(None, "EAGLE-3 draft directory (exported); enables speculative decoding")
    draft_only: bool = setting(False, "serve a speculators-format draft alone (vLLM reads the verifier from its "
                                      "config)")
    k: int = setting(NUM_SPECULATIVE_TOKENS, "draft tokens per speculation round", **K_FLAGS, valid=">= 1")
    host: str = setting("127.0.0.1", "address to listen on")
    port: int = setting(8000, "port to listen on", valid="[1, 65535]")
    max_model_len: int | None = setting(None, "context length (default: 2048 on CPU, the model's own on CUDA)",
                                        valid=">= 1")
    dtype: ServerDtype = setting("auto", "dtype vLLM runs the models in (" + SERVER_DTYPE_CHOICES + ")",
                                 flag="--server-dtype", aliases=("--dtype",))
    served_model_name: str | None = setting(None, "model name clients use (default: the model directory)")
    enforce_eager: bool | Literal["auto"] = setting(
        "auto", SERVER_EAGER_HELP + "with --extract-hidden-states on CPU only)")
    vllm_args: list[str] = setting(default_factory=list, help=VLLM_ARGS_HELP, flag="--vllm-arg",
                                   aliases=("--vllm-args",), commas=False)
    log: str | None = setting(None, "server log file (default: a temporary file)")
    startup_timeout: float = setting(900.0, "seconds to wait for the server to come up", valid="> 0")
    trust_remote_code: bool = setting(False, TRUST_HELP)
    gpu_memory_utilization: float | None = setting(
        None, f"share of GPU memory (on CPU: of RAM) vLLM reserves (default: vLLM's; "
              f"{EXTRACT_GPU_MEMORY_UTILIZATION} with --extract-hidden-states)", valid="(0, 1]")
    extract_hidden_states: bool = setting(False, "serve hidden states for `extract --backend vllm` (speculative "
                                                 "method extract_hidden_states, our KV connector)")
    layer_ids: str | None = setting(None, "aux layers 'low,mid,high' as in extract (default 2,L//2,L-3); the last "
                                          "layer is always captured too")
    hidden_states_dir: str | None = setting(None, "where the server writes each request's states (default: a "
                                                  "temporary directory); pass the same path to the extract client")


@dataclass
class ServingSettings:
    """Section `serving:` of a run config: every vLLM server the pipeline starts (generate, evaluate)."""

    SECTION: ClassVar[str] = "serving"
    dtype: ServerDtype = setting("auto", "dtype the servers run the models in, and extract's HF verifier unless "
                                         "extract.compute_dtype is set (" + SERVER_DTYPE_CHOICES + ")")
    enforce_eager: bool | Literal["auto"] = setting("auto", SERVER_EAGER_HELP + "on CPU only, where a pipeline "
                                                                                  "stage's server starts faster so)")
    max_model_len: int | None = setting(None, CONTEXT_HELP, valid=">= 1")
    vllm_args: list[str] = setting(default_factory=list, help=VLLM_ARGS_HELP, commas=False)


# YAML sections of `eagle3-train run`, in pipeline order.
SECTIONS: dict[str, type] = {
    "generate": GenerateSettings, "prepare": PrepareSettings, "vocab": VocabSettings, "extract": ExtractSettings,
    "train": TrainConfig, "select": SelectSettings, "export": ExportSettings, "evaluate": EvaluateSettings}
# Sections of a run config that are no stage: settings several stages share.
SHARED_SECTIONS: dict[str, type] = {"serving": ServingSettings}
# Settings of commands that are no pipeline section.
COMMANDS: dict[str, type] = {"evaluate offline": OfflineEvalSettings, "evaluate served": ServedEvalSettings,
                             "serve": ServeSettings, "adopt": AdoptSettings, "launch": LaunchSettings,
                             "plan": PlanSettings}

_INTRO = """# Configuration reference

Generated from the settings dataclasses (`src/eagle3_train/settings/`) by
`python -m eagle3_train.settings --markdown > docs/CONFIG.md`; a test keeps it up to date. Do not edit by hand.

One dataclass per stage is the YAML section of `eagle3-train run --config FILE`, the flags of
`eagle3-train STAGE` and the keyword defaults of the stage's Python function. Keys in parentheses are set by the
pipeline itself (paths between stages) and exist only as flags / function arguments. Every stage command takes
`--set KEY=VALUE` (or `--set STAGE.KEY=VALUE`) for any of its keys; `run` takes `--set SECTION.KEY=VALUE`. Values are
read as YAML. A mistyped key is an error naming the closest valid key. Experimental settings (kept for a rerun at GPU
scale) follow a section's other settings in a table of their own.
"""


def config_reference() -> str:
    parts = [_INTRO, markdown_table(RunSettings, "Top level", "Keys at the top of a run config.")]
    for name, cls in SECTIONS.items():
        # the pipeline's evaluate and select sections; the commands are `evaluate offline|served`
        command = name not in ("evaluate", "select")
        intro = f"Section `{name}:` of a run config" + (f"; command `eagle3-train {name}`." if command else ".")
        parts.append(markdown_table(cls, f"`{name}`", intro, flags_shown=command))
    for name, cls in SHARED_SECTIONS.items():
        parts.append(markdown_table(cls, f"`{name}`", f"Section `{name}:` of a run config (no command of its own).",
                                    flags_shown=False))
    for name, cls in COMMANDS.items():
        parts.append(markdown_table(cls, f"`{name}` (command only)", f"Flags of `eagle3-train {name}`."))
    return "\n".join(parts)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m eagle3_train.settings",
                                description="the config reference generated from the settings dataclasses")
    p.add_argument("--markdown", action="store_true", help="print docs/CONFIG.md (the default)")
    p.add_argument("--check", metavar="FILE", help="exit 1 when FILE differs from the generated reference")
    args = p.parse_args(argv)
    text = config_reference()
    if args.check:
        if Path(args.check).read_text() != text:
            print(f"{args.check} is out of date: python -m eagle3_train.settings --markdown > {args.check}")
            return 1
        return 0
    print(text, end="")
    return 0
