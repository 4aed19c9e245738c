"""`train --dry-run` at full size: the Kimi-K2 finetune rehearsal on a simulated AQ-MedAI checkpoint.

Everything is written at its real shape (sparse files: the 2.4 GB draft and the 2 x 2.35 GB verifier head cost no
disk), so this runs in CI in seconds; the width-reduced real forward/backward is benchmarks/kimi_dry_run.py.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from support.kimi_layouts import (
    DEFAULT,
    HEAD_DIM,
    HEADS,
    LAYERS,
    SGLANG_IDS,
    VD,
    H,
    V,
    aq_medai_shapes,
    kimi_train_config,
    write_aq_medai_draft,
    write_kimi_verifier,
    write_run_inputs,
)

from eagle3_train.cli import main as cli_main
from eagle3_train.train.dry_run import METADATA_FILE, dry_run, read_safetensors_header
from eagle3_train.utils.io import Eagle3InputError


@pytest.fixture(scope="module")
def kimi(tmp_path_factory):
    root = tmp_path_factory.mktemp("kimi")
    verifier = write_kimi_verifier(root / "Kimi-K2-Instruct")
    return root, verifier, write_run_inputs(root / "run-inputs", verifier, layer_ids=LAYERS)


@pytest.mark.parametrize("with_embed,policy", [(False, "rebuild"), (True, "keep")])
def test_kimi_finetune_dry_run_at_full_size(kimi, tmp_path, with_embed, policy):
    root, verifier, paths = kimi
    source = write_aq_medai_draft(tmp_path / "Kimi-K2-Instruct-eagle3", with_embed=with_embed)
    out = tmp_path / "train"
    report = dry_run(kimi_train_config(paths, out, finetune_from=str(source), finetune_vocab=policy))

    meta = json.loads((out / METADATA_FILE).read_text())
    assert meta["run"]["status"] == "dry-run" and meta["dry_run"]["checked"] == report["checked"]
    init = meta["init"]
    assert init["method"] == "finetune" and init["vocab_policy"] == policy and init["format"] == "eagle"
    aux = init["aux_layers"]
    assert aux["source"] == list(LAYERS) and aux["source_origin"] == "nested" and aux["match"] is True
    assert aux["source_config_keys"]["eagle_config.eagle_aux_hidden_state_layer_ids"] == SGLANG_IDS
    assert init["keys"]["ignored"] == (["embed_tokens.weight"] if with_embed else []) and not init["keys"]["missing"]
    draft = meta["draft_config"]
    assert (draft["hidden_size"], draft["head_dim"], draft["num_attention_heads"]) == (H, HEAD_DIM, HEADS)
    assert draft["draft_vocab_size"] == VD and draft["vocab_size"] == V and draft["aux_layer_ids"] == list(LAYERS)

    trainable = sum(math.prod(s) for k, s in aq_medai_shapes(False).items())
    assert report["memory"]["trainable_parameters"] == trainable  # d2t/t2d are buffers, the embedding frozen
    assert report["memory"]["frozen_parameters"] == V * H
    assert report["not_checked"] and any("header-only" in c for c in report["not_checked"])

    source_header = read_safetensors_header(source / "model.safetensors")
    for fmt, layer0 in (("eagle", "midlayer."), ("speculators", "layers.0.")):
        d = out / "dry-run-exports" / fmt
        header = read_safetensors_header(d / "model.safetensors")
        for k, v in source_header.items():
            if k != "embed_tokens.weight":
                assert header[k.replace("midlayer.", layer0)]["shape"] == v["shape"]
        assert "embed_tokens.weight" not in header
        assert (d / "model.safetensors").stat().st_blocks * 512 < 2**22  # sparse: the zeros take no disk
    eagle_cfg = json.loads((out / "dry-run-exports" / "eagle" / "config.json").read_text())
    assert eagle_cfg["eagle_aux_hidden_state_layer_ids"] == list(LAYERS)
    assert eagle_cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == SGLANG_IDS
    spec_cfg = json.loads((out / "dry-run-exports" / "speculators" / "config.json").read_text())
    assert spec_cfg["eagle_aux_hidden_state_layer_ids"] == list(LAYERS)


def test_kimi_draft_finetuned_into_peagle_dry_run_at_full_size(kimi, tmp_path):
    """The AQ-MedAI EAGLE-3 draft finetuned as a P-EAGLE draft: its tensors load, mask_hidden [1, 3H] is new (the
    one trainable tensor more), and both header-only exports carry it with the mask token vLLM needs."""
    root, verifier, paths = kimi
    source = write_aq_medai_draft(tmp_path / "Kimi-K2-Instruct-eagle3")
    out = tmp_path / "train"
    report = dry_run(kimi_train_config(paths, out, finetune_from=str(source), method="peagle",
                                       mask_token_id=V - 1))
    meta = json.loads((out / METADATA_FILE).read_text())
    assert (meta["draft_config"]["method"], meta["draft_config"]["mask_token_id"]) == ("peagle", V - 1)
    assert not meta["init"]["keys"]["missing"] and any("trained here as peagle" in n for n in meta["init"]["notes"])
    trainable = sum(math.prod(s) for k, s in aq_medai_shapes(False).items())
    assert report["memory"]["trainable_parameters"] == trainable + 3 * H
    for fmt in ("eagle", "speculators"):
        d = out / "dry-run-exports" / fmt
        assert read_safetensors_header(d / "model.safetensors")["mask_hidden"]["shape"] == (1, 3 * H)
        assert json.loads((d / "config.json").read_text())["mask_token_id"] == V - 1
    assert meta["dry_run"]["exports"]["eagle"]["engines"]["sglang"]["serves_as_trained"] is False


def test_dflash_dry_run_at_full_size(kimi, tmp_path):
    """A DFlash draft for the Kimi-K2 verifier from scratch: the z-lab layout vLLM loads, header-only, checked as
    the engine reads it; no speculators export (vLLM reads that one as causal)."""
    root, verifier, paths = kimi
    out = tmp_path / "train"
    report = dry_run(kimi_train_config(paths, out, method="dflash", mask_token_id=V - 1, ttt_steps=15))
    meta = json.loads((out / METADATA_FILE).read_text())
    assert (meta["draft_config"]["method"], meta["draft_config"]["block_size"]) == ("dflash", 16)
    assert list(report["exports"]) == ["eagle"]
    d = out / "dry-run-exports" / "eagle"
    config = json.loads((d / "config.json").read_text())
    assert config["architectures"] == ["DFlashDraftModel"] and config["model_type"] == "qwen3"
    assert config["dflash_config"]["target_layer_ids"] == [i - 1 for i in meta["draft_config"]["aux_layer_ids"]]
    header = read_safetensors_header(d / "model.safetensors")
    assert header["fc.weight"]["shape"] == (H, 3 * H) and "layers.0.self_attn.k_norm.weight" in header
    assert "hidden_norm.weight" in header and not any(k.startswith("midlayer.") for k in header)


def test_a_run_on_the_default_layers_refuses_the_kimi_draft(kimi, tmp_path):
    root, verifier, _ = kimi
    paths = write_run_inputs(tmp_path / "default-layers", verifier, layer_ids=DEFAULT)
    source = write_aq_medai_draft(tmp_path / "draft")
    with pytest.raises(Eagle3InputError) as e:
        dry_run(kimi_train_config(paths, tmp_path / "train", finetune_from=str(source)))
    msg = str(e.value)
    assert "inputs of verifier layers [3, 31, 59]" in msg and "inputs of verifier layers [2, 30, 58]" in msg
    assert "--layer-ids 3,31,59" in msg and "--allow-aux-layer-mismatch" in msg


def test_cli_dry_run_from_scratch_without_verifier_weights(tmp_path, capsys):
    verifier = write_kimi_verifier(tmp_path / "config-only", with_weights=False)
    paths = write_run_inputs(tmp_path / "inputs", verifier, layer_ids=DEFAULT)
    out = tmp_path / "train"
    rc = cli_main(["train", "--dry-run", "--prepared", str(paths["prepared"]), "--hidden-states",
                   str(paths["hidden"]), "--vocab", str(paths["vocab"]), "--out", str(out)])
    printed = capsys.readouterr().out
    assert rc == 0 and "NOT checked" in printed and "no weight files" in printed
    meta = json.loads((out / METADATA_FILE).read_text())
    assert meta["init"]["method"] == "random" and meta["draft_config"]["head_dim"] == H // HEADS
    assert not (out / "checkpoints").exists()


def test_run_dry_run_validates_the_config_and_says_what_it_did_not_check(tmp_path, capsys):
    verifier = write_kimi_verifier(tmp_path / "K2", with_weights=False)
    config = tmp_path / "kimi.yaml"
    config.write_text(f"run_dir: {tmp_path / 'run'}\nverifier: {verifier}\ntrain:\n  finetune_vocab: rebuild\n")
    assert cli_main(["run", "--config", str(config), "--dry-run"]) == 0
    printed = capsys.readouterr().out
    assert "prepare: would run" in printed and "NOT checked: train" in printed
    assert not (tmp_path / "run").exists()  # a dry run writes nothing
    config.write_text(f"run_dir: {tmp_path / 'run'}\nverifier: {verifier}\ntrain:\n  finetune_vocb: rebuild\n")
    assert cli_main(["run", "--config", str(config), "--dry-run"]) == 2  # a mistyped key fails the dry run


@pytest.fixture
def empty_cache(tmp_path, monkeypatch) -> Path:
    """An empty EAGLE3_TRAIN_CACHE holding every cache of the tool (`datasets`' too), `datasets` kept off the Hub
    itself, and UltraChat (the `ultrachat` preset) within reach as a copy in the Hub mirror: a dry run that fetched
    it, or wrote anything else there, would leave files in the cache."""
    import datasets
    import huggingface_hub.constants

    cache = tmp_path / "cache"
    cache.mkdir()
    monkeypatch.setenv("EAGLE3_TRAIN_CACHE", str(cache))
    for env in ("EAGLE3_TRAIN_DATA_CACHE", "HF_DATASETS_CACHE"):
        monkeypatch.delenv(env, raising=False)
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)  # never the Hub itself
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    repo = tmp_path / "mirror" / "HuggingFaceH4" / "ultrachat_200k"
    (repo / "data").mkdir(parents=True)
    (repo / "README.md").write_text("---\nconfigs:\n- config_name: default\n  data_files:\n  - split: train_sft\n"
                                    "    path: data/train_sft.jsonl\n---\n")
    (repo / "data" / "train_sft.jsonl").write_text(json.dumps({"prompt_id": "u0", "messages": [
        {"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]}) + "\n")
    monkeypatch.setenv("EAGLE3_TRAIN_HUB_MIRROR", str(tmp_path / "mirror"))
    return cache


def cache_files(cache: Path) -> list[str]:
    return sorted(str(p.relative_to(cache)) for p in cache.rglob("*"))


@pytest.mark.parametrize("generate", [False, True], ids=["prepare", "generate"])
def test_a_dry_run_fetches_no_dataset_and_writes_no_cache(tmp_path, capsys, empty_cache, generate):
    """`run --dry-run` on a preset the data cache lacks: the prepare (and generate) key hashes the data file, and
    computing it fetched the whole dataset into the cache (offline, the failure read as "would run"). The plan now
    says what the run would fetch, and the cache stays empty."""
    cache = empty_cache
    verifier = write_kimi_verifier(tmp_path / "K2", with_weights=False)
    config = tmp_path / "c.yaml"
    config.write_text(f"run_dir: {tmp_path / 'run'}\nverifier: {verifier}\nprepare:\n  data: ultrachat\n"
                      + ("generate:\n  enabled: true\n" if generate else ""))
    assert cli_main(["run", "--config", str(config), "--dry-run"]) == 0
    printed = capsys.readouterr().out
    fetch = ("would run (--data ultrachat: not fetched yet: would fetch HuggingFaceH4/ultrachat_200k (config default, "
             "split train_sft))")
    for stage in ("generate", "prepare") if generate else ("prepare",):
        assert f"{stage}: {fetch}" in printed, printed
    assert not list(cache.iterdir()) and not (tmp_path / "run").exists()  # nothing downloaded, nothing written
    if not generate:  # prepared before, its data since deleted from the cache: done unless the data fetched differs
        (tmp_path / "run" / "prepared").mkdir(parents=True)
        (tmp_path / "run" / "prepared" / "manifest.json").write_text("{}")
        (tmp_path / "run" / "pipeline_state.json").write_text(json.dumps({"stages": {"prepare": {}}}))
        assert cli_main(["run", "--config", str(config), "--dry-run"]) == 0
        printed = capsys.readouterr().out
        assert "prepare: done, but may run again (--data ultrachat: not fetched yet: would fetch" in printed, printed
        assert "vocab: would run" in printed and not list(cache.iterdir())


def _chats_file(path: Path, n: int) -> Path:
    path.write_text("".join(json.dumps({"id": f"c{i}", "messages": [
        {"role": "user", "content": f"question {i}"}, {"role": "assistant", "content": f"answer {i}"}]}) + "\n"
        for i in range(n)))
    return path


def test_a_dry_run_keys_a_mixture_without_writing_it(tmp_path, capsys, empty_cache):
    """Several --data sources, or one cut with :N, are read as one mixture file that the prepare key hashes: a dry
    run wrote that file into the data cache once every part was local or cached. It now names the file a run would
    write, and once a run has written it, keys prepare on it as the run does (a stage done on it stays done)."""
    from eagle3_train.assets.data_sources import resolve
    from eagle3_train.pipeline import Pipeline
    from eagle3_train.utils.io import sha256_file, sha256_json

    cache = empty_cache
    chats = _chats_file(tmp_path / "chats.jsonl", 3)
    verifier = write_kimi_verifier(tmp_path / "K2", with_weights=False)
    rd = tmp_path / "run"
    config = tmp_path / "c.yaml"

    def dry_run_plan(data: list[str]) -> str:
        config.write_text(f"run_dir: {rd}\nverifier: {verifier}\nprepare:\n  data: {json.dumps(data)}\n")
        assert cli_main(["run", "--config", str(config), "--dry-run"]) == 0
        return capsys.readouterr().out

    would_write = f"mixture not built yet: would write {cache / 'data' / 'mixtures'}"
    printed = dry_run_plan([f"{chats}:2"])  # one local file, cut
    assert f"prepare: would run (--data {chats}:2: {would_write}" in printed, printed
    assert cache_files(cache) == [] and not rd.exists()

    mixed = [str(chats), "ultrachat"]  # a local file and a Hub dataset: the mixture is keyed once both are here
    assert "prepare: would run (--data ultrachat: not fetched yet: would fetch" in dry_run_plan(mixed)
    assert cache_files(cache) == []
    resolve("ultrachat")  # what a run fetches first
    fetched = cache_files(cache)
    printed = dry_run_plan(mixed)
    assert f"prepare: would run (--data {chats} --data ultrachat: {would_write}" in printed, printed
    assert cache_files(cache) == fetched and not rd.exists()  # the mixture was not written, nor anything else

    mixture = resolve(mixed).path  # what the run writes: the dry run now keys prepare on that file
    assert "  prepare: would run -> prepared/manifest.json" in dry_run_plan(mixed)
    pipeline = Pipeline({"run_dir": str(rd), "verifier": str(verifier), "prepare": {"data": mixed}})
    ctx = pipeline._context(need="tokenizer", dry_run=True)
    pipeline.plan(ctx)
    assert ctx.keys["prepare"]["data_sha256"] == sha256_file(mixture)
    (rd / "prepared").mkdir(parents=True)
    (rd / "prepared" / "manifest.json").write_text("{}")
    (rd / "pipeline_state.json").write_text(json.dumps({"stages": {"prepare": {
        "settings_sha256": sha256_json(ctx.keys["prepare"]), "finished_ns": 1}}}))
    assert "prepare: done (skipped)" in dry_run_plan(mixed)


@pytest.mark.parametrize("generate", [False, True], ids=["prepare", "generate"])
@pytest.mark.parametrize("data, problem", [
    ("ultrachatt", "unknown data preset 'ultrachatt', and no file or directory of that name (did you mean "
                   "'ultrachat'?"),
    ("org/x@", "--data 'org/x@': no split name after '@'"),
    ("{tmp}/missing.jsonl", "data source not found: {tmp}/missing.jsonl"),
    (["{tmp}/chats.jsonl", "{tmp}/missing.jsonl"], "data source not found: {tmp}/missing.jsonl"),
], ids=["mistyped-preset", "malformed-spec", "missing-file", "missing-file-in-mixture"])
def test_a_dry_run_fails_on_data_the_config_names_wrong(tmp_path, capsys, empty_cache, data, problem, generate):
    """prepare.data naming no data (a mistyped preset, a malformed spec, a file that is not there) was shown as
    "would run", the error taken for data an earlier stage has yet to write; the run would stop on it. The dry run
    now fails (exit 2) naming the setting, the stage that reads it and the problem, and writes nothing."""
    _chats_file(tmp_path / "chats.jsonl", 2)
    data = json.dumps(data).replace("{tmp}", str(tmp_path))
    verifier = write_kimi_verifier(tmp_path / "K2", with_weights=False)
    config = tmp_path / "c.yaml"
    config.write_text(f"run_dir: {tmp_path / 'run'}\nverifier: {verifier}\nprepare:\n  data: {data}\n"
                      + ("generate:\n  enabled: true\n" if generate else ""))
    assert cli_main(["run", "--config", str(config), "--dry-run"]) == 2
    printed = capsys.readouterr()
    stage = "generate" if generate else "prepare"
    assert f"error: prepare.data (read by the {stage} stage): " in printed.err, printed.err
    assert problem.replace("{tmp}", str(tmp_path)) in printed.err, printed.err
    assert "would run" not in printed.out
    assert cache_files(empty_cache) == [] and not (tmp_path / "run").exists()


def test_run_dry_run_checks_train_on_the_stages_already_done(kimi, tmp_path, capsys):
    root, verifier, _ = kimi
    rd = tmp_path / "run"
    paths = write_run_inputs(rd, verifier, layer_ids=LAYERS)
    paths["hidden"].rename(rd / "hidden_states")  # the pipeline's directory names
    (rd / "pipeline_state.json").write_text(json.dumps({"stages": {s: {} for s in ("prepare", "vocab", "extract")}}))
    source = write_aq_medai_draft(tmp_path / "draft")
    config = tmp_path / "kimi.yaml"
    config.write_text(f"run_dir: {rd}\nverifier: {verifier}\ntrust_remote_code: true\n"
                      f"train:\n  finetune_from: {source}\n  finetune_vocab: rebuild\n")
    assert cli_main(["run", "--config", str(config), "--dry-run"]) == 0
    printed = capsys.readouterr().out
    assert "extract: done" in printed and "dry run: checked" in printed and "NOT checked" in printed
    meta = json.loads((rd / "train" / METADATA_FILE).read_text())
    assert meta["settings"]["trust_remote_code"] is True and meta["init"]["aux_layers"]["match"] is True


def test_kimi_mla_draft_finetune_dry_run_at_full_size(kimi, tmp_path):
    """The MLA draft vLLM recommends for Kimi-K2.5, at its real shapes: the finetune follows the source's layer kind
    and dims, and the header-only export has the names and config deepseek_eagle3.py loads."""
    from support.kimi_layouts import KIMI_MLA_DRAFT_CONFIG, kimi_mla_draft_shapes, write_kimi_mla_draft

    _, verifier, paths = kimi
    source = write_kimi_mla_draft(tmp_path / "kimi-k2.5-eagle3-mla")
    out = tmp_path / "train"
    report = dry_run(kimi_train_config(paths, out, finetune_from=str(source), finetune_vocab="keep"))
    meta = json.loads((out / METADATA_FILE).read_text())
    draft = meta["draft_config"]
    assert draft["architecture"] == "mla"
    for k in ("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"):
        assert draft[k] == KIMI_MLA_DRAFT_CONFIG[k], k
    assert not meta["init"]["keys"]["missing"] and meta["init"]["aux_layers"]["match"] is True
    shapes = kimi_mla_draft_shapes()
    assert report["memory"]["trainable_parameters"] == sum(math.prod(s) for s in shapes.values())
    assert set(report["exports"]) == {"eagle"}  # the speculators format describes Llama layers only
    header = read_safetensors_header(out / "dry-run-exports" / "eagle" / "model.safetensors")
    assert {k: tuple(v["shape"]) for k, v in header.items() if k not in ("d2t", "t2d")} == shapes
    cfg = json.loads((out / "dry-run-exports" / "eagle" / "config.json").read_text())
    assert cfg["architectures"] == ["Eagle3DeepseekV2ForCausalLM"] and cfg["model_type"] == "kimi_k2"
    # `eagle3-train plan` at the same settings plans this MLA draft, not a Llama one: the same peak, and its
    # weights/optimizer/frozen terms within 10% of the dry run's own count (which adds one target-logits chunk)
    from eagle3_train.plan import PlanSettings, plan

    train = report["data"]["train"]
    planned = plan(PlanSettings(verifier=str(verifier), samples=train["samples"], finetune_from=str(source),
                                tokens_per_sample=train["tokens"] // train["samples"], ttt_steps=7, token_budget=4096))
    assert planned.draft["architecture"] == "mla" and report["memory"]["plan"]["peak_bytes"] == planned.memory["peak"]
    static = sum(planned.memory[k] for k in ("weights_fp32_master", "grads", "optimizer_states", "frozen_embedding",
                                             "verifier_lm_head"))
    assert static == pytest.approx(report["memory"]["per_rank_bytes_without_activations"], rel=0.1)
    assert cfg["eagle_aux_hidden_state_layer_ids"] == list(LAYERS)
    # a setting that contradicts the source is refused by name
    with pytest.raises(Eagle3InputError, match="train.architecture=mla but the finetune source"):
        dry_run(kimi_train_config(paths, tmp_path / "t2", finetune_from=str(write_aq_medai_draft(tmp_path / "aq")),
                                  architecture="mla"))


@pytest.mark.parametrize("torchspec_vllm_export", [True, False])
def test_a_torchspec_export_for_vllm_keeps_its_nested_ids_unshifted(tmp_path, torchspec_vllm_export):
    """TorchSpec's exporter writes a kimi_k2 draft for vLLM with `layers.0.*` names and every aux id +1, the nested
    ones too: those nested ids already mean inputs of layers (vLLM). Its native export (`midlayer.*`) keeps them as
    outputs of layers (SGLang). Read by producer; the note names both readings."""
    from support.draft_layouts import write_sparse_safetensors
    from support.kimi_layouts import AQ_MEDAI_CONFIG, aq_medai_shapes

    from eagle3_train.checkpoints.formats import AUX_NESTED, AUX_NESTED_VLLM, load_draft_source

    d = tmp_path / "torchspec-export"
    d.mkdir()
    nested = [3, 31, 59] if torchspec_vllm_export else [2, 30, 58]
    config = {**AQ_MEDAI_CONFIG, "model_type": "kimi_k2", "_torchspec_version": "0.3.0",
              "eagle_config": {"eagle_aux_hidden_state_layer_ids": nested, "use_aux_hidden_state": True}}
    (d / "config.json").write_text(json.dumps(config))
    prefix = "layers.0." if torchspec_vllm_export else "midlayer."
    shapes = {k.replace("midlayer.", prefix): s for k, s in aq_medai_shapes(False).items()}
    write_sparse_safetensors(d / "model.safetensors", shapes, {})
    loaded = load_draft_source(d, shapes_only=True)
    assert list(loaded.config.aux_layer_ids) == list(LAYERS)  # inputs of 3, 31, 59 either way
    assert loaded.aux_ids_origin == (AUX_NESTED_VLLM if torchspec_vllm_export else AUX_NESTED)
    if torchspec_vllm_export:
        assert any("inputs of layers [3, 31, 59]" in n and "inputs of [4, 32, 60]" in n for n in loaded.notes)



def test_a_source_whose_aux_convention_cannot_be_told_is_refused_until_the_user_says(kimi, tmp_path, capsys):
    """A kimi_k2 draft with `layers.0.*` names and ids only in eagle_config, but no `_torchspec_version`: a TorchSpec
    vLLM export that lost its version key reads one layer earlier than an SGLang-convention draft. Every stage that
    reads its layers refuses it, naming both readings and the flag; the flag decides; inspect shows both."""
    from support.draft_layouts import random_token_ids, vocab_from_ids, write_sparse_safetensors
    from support.kimi_layouts import AQ_MEDAI_CONFIG, aq_medai_shapes

    from eagle3_train.checkpoints.formats import AmbiguousAuxIds, draft_layer_ids, load_draft_source
    from eagle3_train.export.inspect import inspect_checkpoint
    from eagle3_train.plan import PlanSettings, plan

    _, verifier, paths = kimi
    d = tmp_path / "no-producer"
    d.mkdir()
    config = {**AQ_MEDAI_CONFIG, "model_type": "kimi_k2",
              "eagle_config": {"eagle_aux_hidden_state_layer_ids": SGLANG_IDS, "use_aux_hidden_state": True}}
    (d / "config.json").write_text(json.dumps(config))
    d2t, t2d = vocab_from_ids(random_token_ids(VD, seed=13, vocab_size=V), V)
    write_sparse_safetensors(d / "model.safetensors",
                             {k.replace("midlayer.", "layers.0."): s for k, s in aq_medai_shapes(False).items()},
                             {"d2t": d2t, "t2d": t2d})
    with pytest.raises(AmbiguousAuxIds) as e:
        load_draft_source(d, shapes_only=True)
    msg = str(e.value)
    assert f"inputs of layers {list(LAYERS)}" in msg and f"inputs of layers {SGLANG_IDS}" in msg
    assert "--source-aux-convention sglang" in msg and "--source-aux-convention vllm" in msg
    assert draft_layer_ids(d, 61, "sglang")[0] == LAYERS and draft_layer_ids(d, 61, "vllm")[0] == tuple(SGLANG_IDS)
    # train: refused by default, finetunes once told (the dry run reads the source as train does)
    with pytest.raises(Eagle3InputError, match="--source-aux-convention"):
        dry_run(kimi_train_config(paths, tmp_path / "t1", finetune_from=str(d)))
    dry_run(kimi_train_config(paths, tmp_path / "t2", finetune_from=str(d), source_aux_convention="sglang"))
    meta = json.loads((tmp_path / "t2" / METADATA_FILE).read_text())
    assert meta["init"]["aux_layers"]["source"] == list(LAYERS) and meta["init"]["aux_layers"]["match"]
    assert meta["settings"]["source_aux_convention"] == "sglang"
    # plan and the CLI flag
    with pytest.raises(Eagle3InputError, match="cannot be told"):
        plan(PlanSettings(verifier=str(verifier), samples=10, tokens_per_sample=100, finetune_from=str(d)))
    told = plan(PlanSettings(verifier=str(verifier), samples=10, tokens_per_sample=100, finetune_from=str(d),
                             source_aux_convention="vllm"))
    assert told.draft["aux_layer_ids"] == SGLANG_IDS
    assert cli_main(["plan", "--verifier", str(verifier), "--samples", "10", "--tokens-per-sample", "100",
                     "--finetune-from", str(d), "--source-aux-convention", "sglang", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["draft"]["aux_layer_ids"] == list(LAYERS)
    # inspect shows the draft, in one reading, with both named
    shown = inspect_checkpoint(d)
    assert shown["summary"]["aux_layer_ids"] == list(LAYERS) and "--source-aux-convention" in shown["notes"][0]


def test_a_dry_run_on_a_hub_verifier_asks_the_hub_for_no_weight_files(tiny_llama_dir, tmp_path, monkeypatch):
    """`run --dry-run --verifier org/model` reads config, tokenizer and headers: it asked snapshot_download for every
    `*.safetensors` (595 GB for Kimi-K2.5). The hub cannot be reached here, so its download function stands in,
    serving a snapshot of the config and tokenizer files and recording what was asked."""
    import shutil

    import huggingface_hub

    snapshot = tmp_path / "snapshot"
    shutil.copytree(tiny_llama_dir(), snapshot, ignore=shutil.ignore_patterns("*.safetensors"))
    asked: list[list[str]] = []

    def download(repo_id, allow_patterns=None, **kw):
        asked.append(list(allow_patterns or ["*"]))
        return str(snapshot)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", download)
    config = tmp_path / "c.yaml"
    config.write_text(f"run_dir: {tmp_path / 'run'}\nverifier: org/tiny\nprepare:\n  data: sharegpt\n")
    assert cli_main(["run", "--config", str(config), "--dry-run"]) == 0
    assert asked and not any(p.endswith((".safetensors", ".bin", "*")) for a in asked for p in a), asked


@pytest.mark.parametrize("fmt", ["eagle", "speculators"])
def test_a_whole_vocabulary_dry_run_export_holds_no_map_like_the_real_one(tmp_path, fmt):
    """A draft over the whole vocabulary is exported without d2t/t2d (vLLM fails to load a map for it): the dry run's
    header-only export is written and checked the same way, not with a d2t the real export never writes."""
    import torch

    from eagle3_train.model.config import DraftConfig
    from eagle3_train.model.draft import Eagle3Draft
    from eagle3_train.train.dry_run import check_export_as_engines_read_it, export_header_only

    cfg = DraftConfig(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                      intermediate_size=128, vocab_size=512, draft_vocab_size=512, aux_layer_ids=(1, 2, 3))
    with torch.device("meta"):
        model = Eagle3Draft(cfg)
    d2t, t2d = torch.zeros(512, dtype=torch.long), torch.ones(512, dtype=torch.bool)
    out = export_header_only(model, d2t, t2d, fmt, tmp_path / fmt, "verifier")
    header = read_safetensors_header(out / "model.safetensors")
    assert "d2t" not in header and "t2d" not in header and "lm_head.weight" in header
    assert check_export_as_engines_read_it(out, fmt, model, (1, 2, 3), 6)


def test_the_kimi_config_passes_its_dry_run_on_header_only_stand_ins(kimi, tmp_path, capsys):
    """configs/kimi-k25-8gpu.yaml, the seed's run, with its hub ids replaced by full-size header-only stand-ins:
    every section validates, the finetune source is read and fitted, and its layers are the ones extract will tap."""
    _, verifier, _ = kimi
    source = write_aq_medai_draft(tmp_path / "Kimi-K2-Instruct-eagle3")
    chats = tmp_path / "my_chats.jsonl"
    chats.write_text(json.dumps({"messages": [{"role": "user", "content": "q"},
                                              {"role": "assistant", "content": "a"}]}) + "\n")
    config = Path(__file__).resolve().parents[2] / "configs" / "kimi-k25-8gpu.yaml"
    rc = cli_main(["run", "--config", str(config), "--dry-run", "--set", f"run_dir={tmp_path / 'run'}",
                   "--set", f"verifier={verifier}", "--set", f"train.finetune_from={source}",
                   "--set", f"prepare.data={chats}"])
    printed = capsys.readouterr()
    assert rc == 0, printed.err
    assert f"extract taps its layers {list(LAYERS)}" in printed.out, printed.out
    assert not (tmp_path / "run").exists()


def test_an_online_run_whose_server_cannot_sit_beside_training_is_refused(kimi, tmp_path):
    """`run --dry-run` of an online run that serves the verifier itself: the server's share of the weights (from
    the index) and the trainer's planned peak must fit one GPU; 595 GB over 8 x 96 GB GPUs beside training do not."""
    from eagle3_train.pipeline import Pipeline
    from eagle3_train.pipeline.stages import served_beside_training

    _, verifier, _ = kimi
    heavy = tmp_path / "Kimi-K2.5"
    heavy.mkdir()
    (heavy / "config.json").write_text((verifier / "config.json").read_text())
    (heavy / "model.safetensors.index.json").write_text(json.dumps({"metadata": {"total_size": 595_000_000_000},
                                                                     "weight_map": {}}))
    config = {"run_dir": str(tmp_path / "run"), "verifier": str(heavy), "train_processes": 8,
              "prepare": {"max_length": 16384}, "train": {"hidden_states_mode": "online", "ttt_steps": 7}}
    ctx = Pipeline(config)._context(need="tokenizer")
    with pytest.raises(Eagle3InputError, match=r"74\.4 GB per GPU over 8 beside the trainer's planned peak"):
        served_beside_training(ctx, gpu_bytes=96_000_000_000)
    assert "NOT checked" in served_beside_training(ctx, gpu_bytes=None)
    roomy = served_beside_training(Pipeline({**config, "prepare": {"max_length": 512}})._context(need="tokenizer"),
                                   gpu_bytes=288_000_000_000)
    assert roomy.startswith("  train:") and "fit one GPU" in roomy
