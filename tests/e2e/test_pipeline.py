"""`eagle3-train run`: the whole pipeline from a YAML config on a tiny verifier, and a rerun that skips every stage."""

from __future__ import annotations

import json
import re
import shutil

import pytest
import yaml

from eagle3_train.cli import main as cli_main
from eagle3_train.pipeline import Pipeline
from eagle3_train.utils.io import Eagle3InputError


@pytest.mark.slow
def test_pipeline_runs_end_to_end_and_resumes(tmp_path, tiny_llama_dir, capsys):
    verifier = tiny_llama_dir(initializer_range=0.5)
    config = {
        "run_dir": str(tmp_path / "run"), "verifier": str(verifier),
        "prepare": {"data": "sharegpt", "limit": 12, "max_length": 128, "val_fraction": 0.2},
        "vocab": {"size": 512}, "extract": {"dtype": "float32"},
        "train": {"ttt_steps": 2, "max_steps": 3, "token_budget": 512, "tensorboard": False},
        "export": {"formats": ["eagle", "speculators"]},
        "evaluate": {"vllm": False, "offline": True, "num_prompts": 1, "max_tokens": 8, "offline_prompts": 1},
    }
    cfg_file = tmp_path / "run.yaml"
    cfg_file.write_text(yaml.safe_dump(config))
    assert cli_main(["run", "--config", str(cfg_file), "--set", "train.lr=0.001"]) == 0
    out = capsys.readouterr().out
    assert "eagle3-train run summary" in out and "training tokens/s" in out
    run = tmp_path / "run"
    summary = json.loads((run / "summary.json").read_text())
    assert set(summary["exports"]) == {"eagle", "speculators"}
    # how to serve each: vLLM both formats, SGLang the EAGLE one (it does not read the speculators format)
    assert set(summary["serve"]) == {"eagle", "speculators"} and set(summary["serve_sglang"]) == {"eagle"}
    assert "serve with SGLang (eagle)" in out and "--speculative-algorithm EAGLE3" in out
    offline = summary["evaluate"]["offline"]
    assert offline["greedy_identical"] is True and 1.0 <= offline["mean_acceptance_length"] <= 4.0
    assert json.loads((run / "export-eagle" / "config.json").read_text())["architectures"] == ["LlamaForCausalLMEagle3"]
    assert "speculators_config" in json.loads((run / "export-speculators" / "config.json").read_text())
    meta = json.loads((run / "train" / "training_metadata.json").read_text())
    assert meta["settings"]["lr"] == 0.001  # the --set override reached the stage
    state = json.loads((run / "pipeline_state.json").read_text())["stages"]
    assert {"prepare", "vocab", "extract", "train", "export-eagle", "export-speculators", "evaluate"} <= set(state)
    mtimes = {p: p.stat().st_mtime_ns for p in run.rglob("*.safetensors")}
    Pipeline(yaml.safe_load(cfg_file.read_text()) | {"train": {**config["train"], "lr": 0.001}}).run()
    assert {p: p.stat().st_mtime_ns for p in run.rglob("*.safetensors")} == mtimes  # nothing redone

    # Same settings, but train's output is redone (here: its final weights removed): export must follow it.
    shutil.rmtree(run / "train" / "final")
    Pipeline(config | {"train": {**config["train"], "lr": 0.001}}).run()
    assert (run / "train" / "final").is_dir()
    export_weights = run / "export-eagle" / "model.safetensors"
    assert export_weights.stat().st_mtime_ns != mtimes[export_weights]

    # Another learning rate: a new training run from the start, the old one set aside (not resumed, not deleted).
    Pipeline(config | {"train": {**config["train"], "lr": 0.002}, "evaluate": {"vllm": False, "offline": False}}).run()
    meta = json.loads((run / "train" / "training_metadata.json").read_text())
    assert meta["settings"]["lr"] == 0.002
    (aside,) = run.glob("train.previous-*")
    old = json.loads((aside / "training_metadata.json").read_text())
    assert old["settings"]["lr"] == 0.001 and old["run"]["started"] != meta["run"]["started"]


def test_unknown_sections_and_keys_are_named(tmp_path):
    with pytest.raises(Eagle3InputError, match="unknown key 'trian' in the top level.*did you mean 'train'"):
        Pipeline({"trian": {}})
    with pytest.raises(Eagle3InputError, match="lrr"):
        from eagle3_train.settings.train import TrainConfig
        from eagle3_train.utils.config import to_dataclass

        to_dataclass(TrainConfig, {"lrr": 1}, "config section `train`")


def _small_config(tmp_path, verifier, data) -> dict:
    return {
        "run_dir": str(tmp_path / "run"), "verifier": str(verifier),
        "prepare": {"data": str(data), "max_length": 96, "val_fraction": 0.0},
        "vocab": {"size": 256}, "extract": {"dtype": "float32"},
        "train": {"ttt_steps": 1, "max_steps": 1, "token_budget": 256, "tensorboard": False},
        "export": {"formats": ["eagle"]},
    }


@pytest.mark.slow
def test_stages_rerun_when_what_they_read_changes_in_place(tmp_path, tiny_llama_dir):
    from eagle3_train.assets.conversations import load_conversations

    verifier = tmp_path / "verifier"
    shutil.copytree(tiny_llama_dir(), verifier)
    convs, _ = load_conversations("sharegpt", limit=6)
    data = tmp_path / "chats.jsonl"
    rows = [json.dumps({"id": c.id, "messages": c.messages}) for c in convs]
    data.write_text("\n".join(rows) + "\n")
    config = _small_config(tmp_path, verifier, data)
    state_file = tmp_path / "run" / "pipeline_state.json"

    def finished() -> dict[str, str]:
        return {k: v["finished_ns"] for k, v in json.loads(state_file.read_text())["stages"].items()}

    Pipeline(config).run()
    first = finished()
    plan = {name: status for name, (status, _) in Pipeline(config).plan().items()}
    assert plan == {"generate": "off (section 'generate')", "prepare": "done (skipped)", "vocab": "done (skipped)",
                    "extract": "done (skipped)", "train": "done (skipped)", "select": "done (skipped)",
                    "export-eagle": "done (skipped)", "evaluate": "off (section 'evaluate')"}
    kept = json.loads((tmp_path / "run" / "prepared" / "manifest.json").read_text())["counts"]["conversations_read"]
    data.write_text("\n".join(rows[:4]) + "\n")  # the same path, edited in place
    # the plan says what the run below does, and why
    plan = {name: status for name, (status, _) in Pipeline(config).plan().items()}
    assert plan["prepare"] == "done, but would run again (its settings or what it reads changed)"
    assert all(plan[s] == "done, but would run again (prepare run(s) first)" for s in ("vocab", "extract")), plan
    assert plan["train"].startswith("done, but would run again (prepare, vocab, extract")
    assert finished() == first  # a dry run runs nothing
    Pipeline(config).run()
    second = finished()
    assert all(second[s] > first[s] for s in ("prepare", "vocab", "extract", "train", "select", "export-eagle")), (
        first, second)
    m = json.loads((tmp_path / "run" / "prepared" / "manifest.json").read_text())
    assert m["counts"]["conversations_read"] == 4 < kept
    # The verifier's weights rewritten in place (same path, same config): every stage that reads it reruns.
    weights = verifier / "model.safetensors"
    weights.write_bytes(weights.read_bytes())
    Pipeline(config).run()
    third = finished()
    assert all(third[s] > second[s] for s in ("prepare", "extract", "train")), (second, third)


@pytest.mark.slow
def test_on_policy_generation_never_silently_becomes_off_policy(tmp_path, tiny_llama_dir, monkeypatch):
    monkeypatch.setenv("EAGLE3_VLLM_PYTHON", str(tmp_path / "no-such-python"))
    config = _small_config(tmp_path, tiny_llama_dir(), "sharegpt")
    config["prepare"]["limit"] = 4
    config["generate"] = {"enabled": True, "limit": 4}
    with pytest.raises(Eagle3InputError, match="allow_fallback"):
        Pipeline(config).run()
    assert not (tmp_path / "run" / "prepared").exists()
    config["generate"]["allow_fallback"] = True
    summary = Pipeline(config).run()
    assert summary["generate"]["skipped"] is True and summary["data"]["source"]["source"] == "sharegpt"


def test_run_dry_run_after_a_finished_run_on_a_tiny_verifier(tmp_path, tiny_llama_dir, capsys):
    """A 4-layer verifier: EAGLE-3's (2, L//2, L-3) collides there, so the taps are the ones extract chose, and the
    train dry run (its planned peak included) must build the draft on those very layers."""
    config = _small_config(tmp_path, tiny_llama_dir(), "sharegpt")
    config["prepare"]["limit"] = 4
    Pipeline(config).run()
    run = tmp_path / "run"
    trained = json.loads((run / "train" / "training_metadata.json").read_text())["draft_config"]["aux_layer_ids"]
    extracted = json.loads((run / "hidden_states" / "manifest.json").read_text())["layer_ids"]
    assert trained == extracted and len(set(trained)) == 3
    capsys.readouterr()
    report = Pipeline(config).dry_run()
    assert "dry run: checked" in capsys.readouterr().out
    from eagle3_train.train.dry_run import METADATA_FILE

    planned = json.loads((run / "train" / METADATA_FILE).read_text())["draft_config"]["aux_layer_ids"]
    assert planned == trained and report["train"]["memory"]["plan"]["peak_bytes"] > 0


def test_a_verifier_too_shallow_for_three_taps_is_named(tmp_path, tiny_llama_dir):
    from eagle3_train.plan import PlanSettings, plan

    verifier = tiny_llama_dir(num_hidden_layers=2)
    named = rf"verifier {re.escape(str(verifier))} has 2 decoder layers; EAGLE-3 needs at least 3"
    with pytest.raises(Eagle3InputError, match=named):  # what the train dry run's planned peak calls
        plan(PlanSettings(verifier=str(verifier), samples=4, tokens_per_sample=32))
    config = _small_config(tmp_path, verifier, "sharegpt")
    config["prepare"]["limit"] = 4
    with pytest.raises(Eagle3InputError, match=named):  # the run stops at extract, before train
        Pipeline(config).run()


@pytest.mark.slow
def test_extract_and_train_run_as_processes_under_torchrun(tmp_path, tiny_llama_dir):
    """`train_processes: N` launches the HF extract stage and the train stage as `torchrun --standalone
    --nproc-per-node N` (here two CPU processes, gloo): one store written by both, a run with world size N."""
    from eagle3_train.pipeline.torchrun import train_processes

    assert train_processes("auto") == 1 and train_processes(2) == 2  # no CUDA here
    run = tmp_path / "run"
    config = {
        "run_dir": str(run), "verifier": str(tiny_llama_dir(initializer_range=0.5)), "train_processes": 2,
        "prepare": {"data": "sharegpt", "limit": 8, "max_length": 96, "val_fraction": 0.25},
        "vocab": {"size": 256}, "extract": {"dtype": "float32", "shard_tokens": 128},
        "train": {"ttt_steps": 2, "max_steps": 2, "token_budget": 256, "tensorboard": False},
        "export": {"formats": ["eagle"]}, "evaluate": {"vllm": False, "offline": False},
    }
    Pipeline(config).run()
    manifest = json.loads((run / "hidden_states" / "manifest.json").read_text())
    assert manifest["status"] == "complete" and manifest["processes"] == 2
    assert manifest["splits"]["train"]["num_shards"] >= 2
    meta = json.loads((run / "train" / "training_metadata.json").read_text())
    assert meta["run"]["world_size"] == 2 and meta["progress"]["step"] == 2
    assert (run / "export-eagle" / "model.safetensors").is_file()


def served_run_config(tmp_path, tiny_llama_dir, extract: dict | None = None, train: dict | None = None) -> dict:
    """A small run config whose hidden states come from a vLLM server the run starts (needs the vLLM env)."""
    from support.vllm_helpers import require_vllm

    require_vllm()
    return {
        "run_dir": str(tmp_path / "run"), "verifier": str(tiny_llama_dir(initializer_range=0.5)),
        "prepare": {"data": "sharegpt", "limit": 8, "max_length": 96, "val_fraction": 0.25},
        "vocab": {"size": 256}, "extract": extract or {},
        "train": {"ttt_steps": 2, "max_steps": 2, "token_budget": 256, "tensorboard": False, **(train or {})},
        "export": {"formats": ["eagle"]}, "evaluate": {"vllm": False, "offline": False},
        "serving": {"max_model_len": 512},
    }


@pytest.mark.slow
@pytest.mark.vllm
def test_pipeline_exports_the_checkpoint_vllm_accepts_most_from(tmp_path, tiny_llama_dir, capsys):
    """select.by served: each kept checkpoint is served on the validation first turns, and export ships the winner."""
    config = served_run_config(tmp_path, tiny_llama_dir, train={"max_steps": 4, "eval_every": 2, "save_every": 2})
    config["select"] = {"by": "served", "num_prompts": 2, "max_tokens": 8}
    Pipeline(config).run()
    run = tmp_path / "run"
    sel = json.loads((run / "select" / "selection.json").read_text())
    assert sel["by"] == "served" and [c["step"] for c in sel["candidates"]] == [2, 4]
    assert all(c["served"] >= 1.0 for c in sel["candidates"])
    best = max(sel["candidates"], key=lambda c: (c["served"], c["step"]))
    assert sel["selected_step"] == best["step"]
    meta = json.loads((run / "export-eagle" / "training_metadata.json").read_text())
    assert meta["progress"]["step"] == best["step"]
    assert "checkpoint exported" in capsys.readouterr().out


@pytest.mark.slow
@pytest.mark.vllm
def test_pipeline_extracts_through_a_vllm_server_it_starts(tmp_path, tiny_llama_dir, capsys):
    config = served_run_config(tmp_path, tiny_llama_dir, extract={"backend": "vllm", "dtype": "bfloat16"})
    Pipeline(config).dry_run()
    assert "extract: states from a vLLM hidden-state server the run starts here" in capsys.readouterr().out
    Pipeline(config).run()
    run = tmp_path / "run"
    manifest = json.loads((run / "hidden_states" / "manifest.json").read_text())
    assert manifest["backend"] == "vllm" and manifest["status"] == "complete"
    assert (run / "train" / "final").is_dir() and (run / "vllm-extract.log").is_file()
    assert not any((run / "hidden-states-transfer").iterdir())  # every file read and removed
    # the endpoints of a running server are transport, not content: naming one does not redo the stage...
    served = {**config["extract"], "endpoint": ["http://127.0.0.1:9/v1"], "concurrency": 2}
    assert Pipeline(config | {"extract": served}).plan()["extract"][0] == "done (skipped)"
    # ...while what is stored is: another dtype redoes it
    assert "would run again" in Pipeline(config | {"extract": {**served, "dtype": "float32"}}).plan()["extract"][0]


@pytest.mark.slow
@pytest.mark.vllm
def test_pipeline_trains_online_from_a_server_it_starts(tmp_path, tiny_llama_dir, capsys):
    config = served_run_config(tmp_path, tiny_llama_dir, train={"hidden_states_mode": "online"})
    Pipeline(config).dry_run()
    out = capsys.readouterr().out
    assert "extract: off" in out and "online mode, states from a vLLM hidden-state server the run starts" in out
    Pipeline(config).run()
    run = tmp_path / "run"
    meta = json.loads((run / "train" / "training_metadata.json").read_text())
    assert meta["data"]["hidden_states_source"]["mode"] == "online" and meta["progress"]["step"] == 2
    assert not (run / "hidden_states").exists() and (run / "vllm-train.log").is_file()
    assert (run / "export-eagle" / "config.json").is_file()
    # how the states are fetched is transport: other prefetch/concurrency redo nothing; another server (the user's
    # instead of the run's, whose serving settings are in the key) retrains
    transport = {**config["train"], "prefetch": 5, "online_concurrency": 3}
    assert Pipeline(config | {"train": transport}).plan()["train"][0] == "done (skipped)"
    theirs = {**config["train"], "endpoint": ["http://127.0.0.1:9/v1"], "hidden_states_dir": str(tmp_path)}
    assert "would run again" in Pipeline(config | {"train": theirs}).plan()["train"][0]


@pytest.mark.slow
def test_a_finetune_run_extracts_the_source_layers_not_the_default(tmp_path, tiny_llama_dir):
    """`run` with train.finetune_from taps the layers the source was trained on (as `extract --finetune-from`
    does): it used to extract the default layers and have train refuse them after the whole extraction."""
    from eagle3_train.assets.conversations import load_conversations

    verifier = tiny_llama_dir()
    convs, _ = load_conversations("sharegpt", limit=6)
    data = tmp_path / "chats.jsonl"
    data.write_text("".join(json.dumps({"id": c.id, "messages": c.messages}) + "\n" for c in convs))
    first = _small_config(tmp_path / "a", verifier, data)
    Pipeline(first).run()
    source = tmp_path / "source"  # the first run's draft, on layers other than the 4-layer verifier's default
    shutil.copytree(tmp_path / "a" / "run" / "train" / "final", source)
    default = json.loads((source / "draft_config.json").read_text())["aux_layer_ids"]
    cfg = json.loads((source / "draft_config.json").read_text())
    cfg["aux_layer_ids"] = [0, 1, 3]
    assert default != [0, 1, 3]
    (source / "draft_config.json").write_text(json.dumps(cfg))
    config = _small_config(tmp_path / "b", verifier, data)
    config["train"] = {**config["train"], "finetune_from": str(source)}
    Pipeline(config).dry_run()  # reads the source, fits it to the verifier, names the layers extract will tap
    assert not (tmp_path / "b" / "run").exists()
    Pipeline(config).run()
    run = tmp_path / "b" / "run"
    assert json.loads((run / "hidden_states" / "manifest.json").read_text())["layer_ids"] == [0, 1, 3]
    meta = json.loads((run / "train" / "training_metadata.json").read_text())
    assert meta["init"]["method"] == "finetune" and meta["draft_config"]["aux_layer_ids"] == [0, 1, 3]


def test_run_dry_run_refuses_a_finetune_source_made_for_another_verifier(tmp_path, tiny_llama_dir, ref, capsys):
    """Before any stage runs: a source of another hidden size is named, not found after prepare and extract."""
    from support.draft_layouts import write_speculators

    source = write_speculators(ref, tmp_path / "spec")  # SmolLM2-shaped (hidden 576); the tiny verifier has 64
    config = tmp_path / "c.yaml"
    config.write_text(yaml.safe_dump({"run_dir": str(tmp_path / "run"), "verifier": str(tiny_llama_dir()),
                                      "prepare": {"data": "sharegpt"}, "train": {"finetune_from": str(source)}}))
    assert cli_main(["run", "--config", str(config), "--dry-run"]) == 2
    err = capsys.readouterr().err
    assert f"train.finetune_from {source}" in err and "hidden size 576" in err, err
