"""The export records which engines serve the draft as trained; `inspect` shows it; `export --for` enforces it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from support.draft_layouts import reference_draft, write_ours

from eagle3_train import cli
from eagle3_train.export.exporter import export
from eagle3_train.export.inspect import format_report, inspect_checkpoint
from eagle3_train.utils.io import Eagle3InputError


@pytest.fixture(scope="module")
def runs(tmp_path_factory, head, vocab_a, ref):
    root = tmp_path_factory.mktemp("runs")
    plain = write_ours(ref, root / "plain")
    eagle31 = write_ours(reference_draft(head[0], vocab_a, norm_before_fc=True, norm_output=True), root / "eagle31")
    return plain, eagle31


def test_plain_draft_serves_as_trained_in_both_engines(runs, tmp_path):
    r = export(runs[0], tmp_path / "x", fmt="eagle", engine="sglang")
    assert r["engines"]["sglang"]["serves_as_trained"] and r["engines"]["vllm"]["serves_as_trained"]
    meta = json.loads((tmp_path / "x" / "training_metadata.json").read_text())
    assert meta["export"]["engines"] == r["engines"]


def test_sglang_target_refuses_options_it_ignores(runs, head, vocab_a, tmp_path, capsys):
    """Per SGLang loader (the release read, SGLANG_READ): llama_eagle3.py applies the Eagle 3.1 norms but implements
    norm_before_residual false only; the MLA loader builds one layer."""
    from test_mla_draft import mla_config

    from eagle3_train.model.engines import SGLANG_LOADERS, engine_support, markdown_table

    nbr = write_ours(reference_draft(head[0], vocab_a, norm_before_residual=True), tmp_path / "nbr")
    with pytest.raises(Eagle3InputError, match=r"norm_before_residual=true: SGLang's llama_eagle3.py"):
        export(nbr, tmp_path / "x", fmt="eagle", engine="sglang")
    assert not (tmp_path / "x").exists()
    assert cli.main(["export", str(nbr), "--out", str(tmp_path / "y"), "--for", "sglang"]) == 2
    assert "implements false only" in capsys.readouterr().err
    # the Eagle 3.1 norms: served as trained by the release read; older releases need norm_output's PR
    r = export(runs[1], tmp_path / "eagle31", fmt="eagle", engine="sglang")
    sg = r["engines"]["sglang"]
    assert sg["serves_as_trained"] and [x.split(":")[0] for x in sg["older_releases_need"]] == ["norm_output"]
    # the speculators format is not SGLang's; the verdict is recorded and shown by inspect
    r = export(runs[1], tmp_path / "spec", fmt="speculators", verifier="some/verifier", engine="vllm")
    sg, vl = r["engines"]["sglang"], r["engines"]["vllm"]
    assert not sg["serves_as_trained"] and any("speculators format" in x for x in sg["reasons"])
    assert vl["serves_as_trained"] and any("#46488" in x for x in vl["older_releases_need"])
    text = format_report(inspect_checkpoint(tmp_path / "spec"))
    assert "sglang: NOT as trained" in text and "vllm: serves it as trained" in text
    # the EAGLE format too: vLLM's model code reads norm_output only from PR #42764 on
    eagle = export(runs[1], tmp_path / "eagle", fmt="eagle")["engines"]["vllm"]
    assert eagle["older_releases_need"] == ["norm_output: vLLM PR #42764"]
    # an MLA draft: SGLang's Eagle3DeepseekV2ForCausalLM, one layer only
    assert SGLANG_LOADERS["mla"].architecture == "Eagle3DeepseekV2ForCausalLM"
    from dataclasses import replace

    assert engine_support(replace(mla_config(), aux_layer_ids=(2, 3, 4)), "eagle")["sglang"]["serves_as_trained"]
    two = engine_support(replace(mla_config(num_layers=2), aux_layer_ids=(2, 3, 4)), "eagle")["sglang"]
    assert not two["serves_as_trained"] and "2 layers" in two["reasons"][0]
    # its DeepSeek target adds 1 to the eagle_config ids only when the first is 1 (SGLang PR #25454): the export's
    # [0, 1, 2] (outputs of those layers) would be read as inputs of 0, 1, 2 there
    early = engine_support(mla_config(), "eagle")["sglang"]  # its taps: inputs of layers 1, 2, 3
    assert not early["serves_as_trained"] and "one layer early" in early["reasons"][0]
    # the table the docs carry
    doc = (Path(__file__).resolve().parents[2] / "docs" / "VERIFIER_FAMILIES.md").read_text()
    assert markdown_table() in doc, "docs/VERIFIER_FAMILIES.md is stale: python -m eagle3_train.model.engines " \
                                    "--markdown"


def test_speculators_format_is_not_for_sglang(runs, tmp_path):
    with pytest.raises(Eagle3InputError, match="does not read the speculators format"):
        export(runs[0], tmp_path / "x", fmt="speculators", verifier="v", engine="sglang")


def test_speculators_export_records_the_verifier_as_the_user_named_it(head, vocab_a, tmp_path):
    ref = reference_draft(head[0], vocab_a)  # its own: the test edits its config
    ref.config.verifier["name_or_path"] = "HuggingFaceTB/SmolLM2-135M-Instruct"  # what the user passed to train
    local = "/home/me/.cache/eagle3-train/verifiers/smollm2"  # where it resolved on the training machine
    run = write_ours(ref, tmp_path / "run", {"verifier": {"name": ref.config.verifier["name_or_path"], "path": local}})
    export(run, tmp_path / "spec", fmt="speculators")
    cfg = json.loads((tmp_path / "spec" / "config.json").read_text())
    assert cfg["speculators_config"]["verifier"]["name_or_path"] == "HuggingFaceTB/SmolLM2-135M-Instruct"


def test_speculators_export_names_a_verifier_vllm_can_load(tmp_path):
    from eagle3_train.assets.verifier import resolve_verifier, servable_verifier

    assert servable_verifier("HuggingFaceTB/SmolLM2-135M-Instruct") == "HuggingFaceTB/SmolLM2-135M-Instruct"
    # The embedded name is ours alone: vLLM gets the converted checkpoint directory.
    assert servable_verifier("smollm2-135m-instruct") == str(resolve_verifier("smollm2-135m-instruct"))
    (tmp_path / "v").mkdir()
    assert servable_verifier(tmp_path / "v") == str((tmp_path / "v").resolve())


@pytest.mark.parametrize("order", ["sorted", "shuffled"])
def test_a_draft_over_the_whole_vocabulary_exports_as_vllm_loads_it(head, tmp_path, order):
    """Vd = V: vLLM keeps no draft-to-target map and fails to load a d2t, so the export has none and its lm_head
    rows are in token order; it proposes the same tokens with the same logits (the export's own reload check)."""
    import torch
    from safetensors import safe_open
    from support.draft_layouts import V

    from eagle3_train.checkpoints.formats import load_draft_source

    ids = torch.arange(V) if order == "sorted" else torch.randperm(V, generator=torch.Generator().manual_seed(0))
    ref = reference_draft(head[0], (ids - torch.arange(V), torch.ones(V, dtype=torch.bool)))
    run = write_ours(ref, tmp_path / "run")
    export(run / "final", tmp_path / "draft", fmt="eagle", dtype="float32", verifier="smollm2-test")
    with safe_open(str(tmp_path / "draft" / "model.safetensors"), "pt") as f:
        assert "d2t" not in f.keys() and "t2d" not in f.keys()
        lm_head = f.get_tensor("lm_head.weight")
    assert torch.equal(lm_head[ids], ref.lm_head.weight)  # row of token t = the draft row that proposed t
    loaded = load_draft_source(tmp_path / "draft")
    assert torch.equal(loaded.tensors["d2t"], torch.zeros(V, dtype=torch.long))


def test_the_printed_serve_command_carries_trust_remote_code_when_the_run_used_it(ref, tmp_path):
    plain = write_ours(ref, tmp_path / "plain", {"settings": {"trust_remote_code": False}})
    kimi = write_ours(ref, tmp_path / "kimi", {"settings": {"trust_remote_code": True}})
    result = export(plain, tmp_path / "a", fmt="eagle", verifier="v")
    assert "--trust-remote-code" not in result["serve"] + result["serve_sglang"]
    # SGLang's launch line beside vLLM's: the same chain of k drafted tokens
    sglang = result["serve_sglang"].split()
    assert sglang[:3] == ["python", "-m", "sglang.launch_server"]
    flags = dict(zip(sglang[3::2], sglang[4::2]))
    assert (flags["--speculative-algorithm"], flags["--speculative-draft-model-path"]) == ("EAGLE3",
                                                                                        str(tmp_path / "a"))
    assert (flags["--speculative-eagle-topk"], int(flags["--speculative-num-draft-tokens"])) == (
        "1", int(flags["--speculative-num-steps"]) + 1)
    assert "--pipeline-parallel-size 1" in result["serve_notes"][0]  # no embedding exported: PP >= 2 needs one
    for fmt in ("eagle", "speculators"):
        result = export(kimi, tmp_path / fmt, fmt=fmt, verifier="v")
        assert result["serve"].endswith(" --trust-remote-code")
        # SGLang reads the EAGLE format only
        assert result["serve_sglang"].endswith(" --trust-remote-code") if fmt == "eagle" else \
            result["serve_sglang"] is None


def test_an_mla_draft_with_a_norm_over_the_taps_is_not_served_as_trained_by_vllm():
    """vLLM 0.32's deepseek_eagle3.py reads fc_norm and norm_output but has no norm over the concatenated aux states:
    the verdict says so (the file in the vLLM env is checked when it is installed)."""
    from test_mla_draft import mla_config

    from eagle3_train.model.engines import engine_support

    plain = engine_support(mla_config(), "eagle")["vllm"]
    assert plain["serves_as_trained"] and not plain["reasons"]
    for option in ("fc_norm", "norm_output"):
        assert engine_support(mla_config(**{option: True}), "eagle")["vllm"]["serves_as_trained"], option
    with pytest.raises(Eagle3InputError, match="norm_before_fc is not served on an MLA draft"):
        mla_config(norm_before_fc=True)  # refused before anything trains it
    import glob

    sources = glob.glob(str(Path(__file__).resolve().parents[2] / ".venv-vllm/lib/python3*/site-packages/vllm/"
                                                                 "model_executor/models/deepseek_eagle3.py"))
    for source in sources:  # the fact the verdict rests on, read from the vLLM this project serves with
        text = Path(source).read_text()
        assert "norm_before_fc" not in text and "fc_norm" in text and "norm_output" in text


def test_an_mla_draft_named_deepseek_v3_is_not_served_as_an_eagle3_draft_by_vllm(tmp_path):
    """vLLM rewrites a deepseek_v3 draft into DeepSeek-MTP: inspect of such a published draft says so, while the
    kimi_k2 model_type our MLA exports write is served."""
    from test_mla_draft import mla_config

    from eagle3_train.model.engines import engine_support

    assert not engine_support(mla_config(), "eagle", model_type="deepseek_v3")["vllm"]["serves_as_trained"]
    assert "DeepSeek-MTP" in engine_support(mla_config(), "eagle", model_type="deepseek_v3")["vllm"]["reasons"][0]
    assert engine_support(mla_config(), "eagle", model_type="kimi_k2")["vllm"]["serves_as_trained"]
    from eagle3_train.export.inspect import _layer_model_type

    assert _layer_model_type({"model_type": "deepseek_v3"}) == "deepseek_v3"
    assert _layer_model_type({"model_type": "x", "transformer_layer_config": {"model_type": "kimi_k2"}}) == "kimi_k2"
