"""The named recipes (configs/*-8gpu.yaml, listed in docs/RECIPES.md) pass `eagle3-train run --dry-run` on header-only
stand-ins of their verifiers: the hub ids are replaced with `--set`, everything else is the file as shipped.

Each recipe is dry-run twice: as a fresh run (every section validated, the finetune source read and fitted), and with
stand-in outputs of prepare, vocab and extract in its run directory, so that the dry run goes on to `train --dry-run`
and builds the recipe's draft at full size from the recipe's own train section. All stand-ins are full-size
(tests/support/named_layouts.py, tests/support/kimi_layouts.py): sparse zeros where weights would be.
"""

from __future__ import annotations

import json
import shlex
from pathlib import Path

import pytest
import yaml
from support.kimi_layouts import LAYERS, SGLANG_IDS, write_aq_medai_draft, write_kimi_k25_verifier, write_run_inputs
from support.named_layouts import write_llama31_8b, write_qwen3_8b, write_stage_outputs

from eagle3_train.assets.data_presets import CACHE_ENV
from eagle3_train.assets.thinking import resolve_style
from eagle3_train.cli import build_parser
from eagle3_train.cli import main as cli_main
from eagle3_train.model.aux_layers import default_layer_ids
from eagle3_train.model.config import DraftConfig
from eagle3_train.plan import PlanSettings, plan
from eagle3_train.train.dry_run import METADATA_FILE

ROOT = Path(__file__).resolve().parents[2]
RECIPES_DOC = ROOT / "docs" / "RECIPES.md"
GB = 1e9

# config file -> (the hub id it names, the stand-in writer, GB per GPU its header promises)
FROM_SCRATCH = {
    "llama8b-8gpu.yaml": ("meta-llama/Llama-3.1-8B-Instruct", write_llama31_8b, 80),
    "qwen3-8b-thinking-8gpu.yaml": ("Qwen/Qwen3-8B", write_qwen3_8b, 80),
}
KIMI = "kimi-k25-8gpu.yaml"
NAMED = [*FROM_SCRATCH, KIMI]


def recipe(name: str) -> dict:
    return yaml.safe_load((ROOT / "configs" / name).read_text())


def dry_run(name: str, *sets: str) -> int:
    argv = ["run", "--config", str(ROOT / "configs" / name), "--dry-run"]
    for s in sets:
        argv += ["--set", s]
    return cli_main(argv)


@pytest.fixture
def empty_cache(tmp_path, monkeypatch) -> Path:
    """An empty tool cache (the data cache under it): a dry run fetches no dataset (a recipe's `ultrachat` is "not
    fetched yet") and writes nothing, so it stays empty."""
    cache = tmp_path / "cache"
    cache.mkdir()
    monkeypatch.setenv("EAGLE3_TRAIN_CACHE", str(cache))
    monkeypatch.delenv(CACHE_ENV, raising=False)
    return cache


@pytest.mark.parametrize("name", list(FROM_SCRATCH))
def test_a_from_scratch_recipe_dry_runs_through_training_at_full_size(name, tmp_path, capsys, empty_cache):
    hub_id, write_verifier, gpu_gb = FROM_SCRATCH[name]
    cfg = recipe(name)
    assert cfg["verifier"] == hub_id  # the stand-in imitates the model the recipe names
    verifier = write_verifier(tmp_path / hub_id.split("/")[1])
    rd = tmp_path / "run"
    sets = (f"run_dir={rd}", f"verifier={verifier}")

    # a fresh run: every section is valid, nothing is written, training waits for its inputs
    assert dry_run(name, *sets) == 0, capsys.readouterr().err
    printed = capsys.readouterr().out
    assert "prepare: would run" in printed and "NOT checked: train" in printed, printed
    assert not rd.exists()

    # with prepare, vocab and extract done: the train dry run builds the recipe's draft at full size
    vcfg = json.loads((verifier / "config.json").read_text())
    layers = default_layer_ids(vcfg["num_hidden_layers"])
    write_stage_outputs(rd, verifier, layers, draft_vocab=cfg["vocab"]["size"])
    assert dry_run(name, *sets) == 0, capsys.readouterr().err
    printed = capsys.readouterr().out
    assert "dry run: checked" in printed and "eagle export (header-only)" in printed, printed
    meta = json.loads((rd / "train" / METADATA_FILE).read_text())
    assert meta["init"]["method"] == "random"
    for key in ("ttt_steps", "epochs", "token_budget", "lr", "precision"):
        assert meta["settings"][key] == cfg["train"][key], key  # the recipe's train section reached the trainer
    expected = DraftConfig.from_verifier(vcfg, cfg["vocab"]["size"], aux_layer_ids=layers)
    draft = meta["draft_config"]
    for key in ("hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim", "intermediate_size",
                "vocab_size", "draft_vocab_size"):
        assert draft[key] == getattr(expected, key), key
    assert draft["aux_layer_ids"] == list(layers)
    exports = rd / "train" / "dry-run-exports"
    assert set(cfg["export"]["formats"]) <= {p.name for p in exports.iterdir()}  # each format it exports, checked
    eagle = json.loads((exports / "eagle" / "config.json").read_text())
    assert eagle["hidden_size"] == vcfg["hidden_size"] and eagle["vocab_size"] == vcfg["vocab_size"]
    assert not list(empty_cache.iterdir())  # neither dry run fetched or wrote data

    # the header's hardware: the planner's training peak at the recipe's settings and its longest sample fits
    planned = plan(PlanSettings(verifier=str(verifier), samples=10_000, tokens_per_sample=cfg["prepare"]["max_length"],
                                ttt_steps=cfg["train"]["ttt_steps"], token_budget=cfg["train"]["token_budget"],
                                gpus=8, gpu_memory_gb=gpu_gb, dtype=cfg["extract"]["dtype"]))
    assert planned.memory["peak"] < gpu_gb * GB


def test_the_thinking_recipe_regenerates_with_thinking_on_as_qwen_serves_it(tmp_path):
    """Qwen3-8B's recipe: generate finds the qwen3 thinking style in the verifier's chat template, keeps the
    reasoning, samples as Qwen recommends for thinking, and its servers parse the reasoning out."""
    cfg = recipe("qwen3-8b-thinking-8gpu.yaml")
    verifier = write_qwen3_8b(tmp_path / "Qwen3-8B")
    style, how = resolve_style(cfg["generate"].get("thinking_style", "auto"), cfg["verifier"], verifier)
    assert (style.name, how) == ("qwen3", "chat template")
    gen = cfg["generate"]
    assert gen["reasoning"] == "keep" and style.request_extra(gen["reasoning"]) is None  # thinking stays on
    recommended = style.recommended(gen["reasoning"])
    assert (gen["temperature"], gen["top_p"]) == (recommended.temperature, recommended.top_p)
    args = cfg["serving"]["vllm_args"]
    assert args[args.index("--reasoning-parser") + 1] == "qwen3"


def test_the_kimi_recipe_dry_runs_the_k25_layout_through_the_rebuilt_finetune(tmp_path, capsys, empty_cache):
    """configs/kimi-k25-8gpu.yaml on Kimi-K2.5's own checkpoint layout (the multimodal wrapper, INT4 experts, sharded
    by an index) and the AQ-MedAI draft: the source's layers are the ones extract taps, and the train dry run
    finetunes it on a rebuilt vocabulary at full size. The recipe extracts from a vLLM server the run starts, so its
    dry run also checks that the vLLM environment exists (`scripts/setup.sh --vllm`, as for the whole suite)."""
    cfg = recipe(KIMI)
    verifier = write_kimi_k25_verifier(tmp_path / "Kimi-K2.5")
    source = write_aq_medai_draft(tmp_path / "Kimi-K2-Instruct-eagle3")
    chats = tmp_path / "my_chats.jsonl"
    chats.write_text(json.dumps({"messages": [{"role": "user", "content": "q"},
                                              {"role": "assistant", "content": "a"}]}) + "\n")
    rd = tmp_path / "run"
    sets = (f"run_dir={rd}", f"verifier={verifier}", f"train.finetune_from={source}", f"prepare.data={chats}")
    assert dry_run(KIMI, *sets) == 0, capsys.readouterr().err
    printed = capsys.readouterr().out
    assert f"extract taps its layers {list(LAYERS)}" in printed and "NOT checked: train" in printed, printed
    assert not rd.exists()

    paths = write_run_inputs(rd, verifier, layer_ids=LAYERS)
    paths["hidden"].rename(rd / "hidden_states")  # the pipeline's directory name
    (rd / "pipeline_state.json").write_text(json.dumps({"stages": {s: {} for s in ("prepare", "vocab", "extract")}}))
    assert dry_run(KIMI, *sets) == 0, capsys.readouterr().err
    assert "dry run: checked" in capsys.readouterr().out
    meta = json.loads((rd / "train" / METADATA_FILE).read_text())
    init = meta["init"]
    assert init["method"] == "finetune" and init["vocab_policy"] == cfg["train"]["finetune_vocab"] == "rebuild"
    assert init["aux_layers"]["match"] is True
    assert init["aux_layers"]["source_config_keys"]["eagle_config.eagle_aux_hidden_state_layer_ids"] == SGLANG_IDS
    assert meta["settings"]["trust_remote_code"] is True
    text = json.loads((verifier / "config.json").read_text())["text_config"]
    assert meta["draft_config"]["hidden_size"] == text["hidden_size"]
    assert meta["draft_config"]["vocab_size"] == text["vocab_size"]
    assert set(cfg["export"]["formats"]) <= {p.name for p in (rd / "train" / "dry-run-exports").iterdir()}
    assert not list(empty_cache.iterdir())


def test_recipes_md_lists_each_named_recipe_with_commands_that_parse():
    """docs/RECIPES.md names every named recipe; its `eagle3-train` commands parse with the real CLI and name only
    configs that exist; each recipe's header says which figures are published rather than measured."""
    doc = RECIPES_DOC.read_text()
    for name in NAMED:
        assert f"configs/{name}" in doc, name
        header = "".join(line for line in (ROOT / "configs" / name).read_text().splitlines(keepends=True)
                         if line.startswith("#"))
        assert "published" in header and "not measured here" in header and "Hardware:" in header, name
    commands = [line.strip().split(" #")[0] for line in doc.replace("\\\n", " ").splitlines()
                if line.strip().startswith("eagle3-train ")]
    assert commands
    for command in commands:
        argv = shlex.split(command)[1:]
        build_parser(argv).parse_args(argv)  # exits (a failure here) on a flag the CLI does not have
        for i, arg in enumerate(argv[:-1]):
            if arg == "--config":
                assert (ROOT / argv[i + 1]).is_file(), command
