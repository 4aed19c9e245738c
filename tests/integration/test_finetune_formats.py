"""Finetuning from published drafts: every layout loads to the same network; wrong or broken sources stop clearly.

One random reference draft at SmolLM2's dimensions is written by test helpers (support/draft_layouts.py) in each layout
the field publishes; each must come back through `finetune_model` (read -> check -> build for this verifier -> load)
with bit-identical logits.
"""

from __future__ import annotations

import hashlib
import logging
from pathlib import Path

import pytest
import torch
from support.draft_layouts import (
    LAYER_IDS,
    VD,
    bf16_exact,
    make_inputs,
    probe_logits,
    reference_draft,
    train_config,
    vocab_from_ids,
    write_big_eagle_draft,
    write_eagle_original,
    write_ours,
    write_sharded,
    write_specforge,
    write_speculators,
)

from eagle3_train.checkpoints.native import save_checkpoint
from eagle3_train.export.exporter import export
from eagle3_train.model.draft import Eagle3Draft
from eagle3_train.train.build import build_model
from eagle3_train.train.finetune import apply_finetune_source, finetune_model, load_finetune_source
from eagle3_train.train.metadata import build_metadata
from eagle3_train.utils.io import Eagle3InputError


@pytest.fixture(scope="module")
def ref_logits(ref):
    return probe_logits(ref)


def sha256(path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def write_layout(layout: str, ref: Eagle3Draft, embed: torch.Tensor, tmp):
    """-> (source as given to --finetune-from, the format the reader must report)."""
    d = tmp / layout
    if layout == "eagle_original":
        return write_eagle_original(ref, d), "eagle"
    if layout == "specforge":
        return write_specforge(ref, d, embed), "eagle"
    if layout == "speculators":
        return write_speculators(ref, d), "speculators"
    if layout == "sharded":
        return write_sharded(ref, d), "eagle"
    if layout == "single_file":
        return write_speculators(ref, d) / "model.safetensors", "speculators"
    run = write_ours(ref, tmp / "run")
    if layout == "ours_run":
        return run, "eagle3-train"
    fmt = layout.removeprefix("export_")
    export(run / "final", d, fmt=fmt, dtype="float32", verifier="smollm2-test")
    return d, fmt


@pytest.mark.parametrize("layout", ["eagle_original", "specforge", "speculators", "sharded", "single_file",
                                    "ours_run", pytest.param("export_eagle", marks=pytest.mark.slow),
                                    pytest.param("export_speculators", marks=pytest.mark.slow)])
def test_every_layout_loads_to_the_same_network(layout, ref, ref_logits, head, inputs, tmp_path):
    source, fmt = write_layout(layout, ref, head[0], tmp_path)
    model, record = finetune_model(train_config(source), inputs)
    assert torch.equal(probe_logits(model), ref_logits)
    assert torch.equal(model.d2t, ref.d2t) and torch.equal(model.t2d, ref.t2d)
    assert model.config.aux_layer_ids == LAYER_IDS
    assert record["method"] == "finetune" and record["format"] == fmt and record["source"] == str(source)
    assert record["keys"]["missing"] == []
    resolved = Path(record["resolved"])
    files = [resolved] if resolved.is_file() else [p for p in sorted(resolved.iterdir())
                                                   if p.suffix in (".safetensors", ".bin")]
    assert record["weight_files"] == {p.name: sha256(p) for p in files}
    if layout in ("eagle_original", "specforge", "sharded", "export_eagle"):
        assert record["keys"]["renamed"]["midlayer.self_attn.q_proj.weight"] == "layers.0.self_attn.q_proj.weight"
    assert record["source_config_summary"]["draft_vocab_size"] == VD
    assert record["vocab_overlap"]["shared_tokens"] == VD  # the run's vocab is the source's here


def test_specforge_nested_aux_ids_and_embed_are_reported(ref, head, inputs, tmp_path, caplog):
    source = write_specforge(ref, tmp_path / "sf", head[0])
    with caplog.at_level(logging.WARNING):
        _, record = finetune_model(train_config(source), inputs)
    assert record["source_config_summary"]["aux_ids_origin"] == "nested"
    assert any("only in eagle_config" in n for n in record["notes"])
    assert any("only in eagle_config" in r.getMessage() for r in caplog.records if r.levelno == logging.WARNING)
    assert record["keys"]["ignored"] == ["embed_tokens.weight"]
    assert any("equals the verifier's" in n for n in record["notes"])


def test_stored_embedding_that_differs_is_warned_and_not_used(ref, ref_logits, head, inputs, tmp_path):
    other = bf16_exact(head[0] + 0.1)
    source = write_specforge(ref, tmp_path / "sf", other)
    model, record = finetune_model(train_config(source), inputs)
    assert any("differs from verifier" in n for n in record["notes"])
    assert torch.equal(model.embed_tokens.weight, head[0])
    assert torch.equal(probe_logits(model), ref_logits)


EAGLE31 = [
    {"norm_before_fc": True, "norm_output": True, "norm_before_residual": True},
    {"fc_norm": True, "norm_before_residual": True},
    {"norm_before_residual": True, "num_layers": 2, "intermediate_size": 1024},
]


@pytest.mark.slow
@pytest.mark.parametrize(("flags", "export_fmt"), list(zip(EAGLE31, ["speculators", "eagle", "speculators"])),
                         ids=["norm_before_fc+norm_output", "fc_norm", "two_layers"])
def test_eagle31_speculators_draft_finetunes_and_exports_unchanged(flags, export_fmt, head, vocab_a, inputs,
                                                                    tmp_path):
    ref = reference_draft(head[0], vocab_a, seed=3, **flags)
    expected = probe_logits(ref)
    model, record = finetune_model(train_config(write_speculators(ref, tmp_path / "spec")), inputs)
    for k, v in flags.items():
        assert getattr(model.config, k) == v
    assert torch.equal(probe_logits(model), expected)
    assert any("train.norm_before_residual=False replaced" in n for n in record["notes"])
    # ...and the finetuned draft exports to the same predictions (read back by the finetune path itself).
    ckpt = save_checkpoint(tmp_path / "ckpt", model, None, {"init": record})
    export(ckpt, tmp_path / "export", fmt=export_fmt, dtype="float32", verifier="smollm2-test")
    again, _ = finetune_model(train_config(tmp_path / "export"), inputs)
    assert torch.equal(probe_logits(again), expected)


def test_speculators_config_without_norm_before_residual_means_true(head, vocab_a, inputs, tmp_path):
    ref = reference_draft(head[0], vocab_a, seed=4, norm_before_residual=True)
    source = write_speculators(ref, tmp_path / "spec", with_nbr_key=False)
    model, record = finetune_model(train_config(source), inputs)
    assert model.config.norm_before_residual is True
    assert torch.equal(probe_logits(model), probe_logits(ref))
    assert any("no norm_before_residual" in n for n in record["notes"])


# --- a source made for another verifier stops before anything is built ----------------------------------------------
def test_draft_for_a_7168_wide_verifier_is_refused_naming_the_tensor(inputs, tmp_path):
    source = write_big_eagle_draft(tmp_path / "kimi-eagle3", hidden=7168, heads=64, inter=18432, vocab=163840,
                                   draft_vocab=32000)
    with pytest.raises(Eagle3InputError) as e:
        finetune_model(train_config(source), inputs)
    msg = str(e.value)
    assert "'fc.weight'" in msg and "[7168, 21504]" in msg and "[7168, 1728]" in msg  # fc must read 3 x 576
    assert "hidden size 7168" in msg and "smollm2-test" in msg


def test_draft_for_another_tokenizer_is_refused_naming_t2d(inputs, tmp_path):
    source = write_big_eagle_draft(tmp_path / "gpt2-vocab", hidden=576, heads=9, inter=1536, vocab=50257,
                                   draft_vocab=VD)
    with pytest.raises(Eagle3InputError, match=r"'t2d' has shape \[50257\].*49152 tokens"):
        finetune_model(train_config(source), inputs)


def test_other_aux_layers_are_refused(ref, inputs, tmp_path):
    source = write_speculators(ref, tmp_path / "spec", aux_ids=[3, 16, 28])
    with pytest.raises(Eagle3InputError) as e:
        finetune_model(train_config(source), inputs)
    assert "[3, 16, 28]" in str(e.value) and "[2, 15, 27]" in str(e.value) and "--layer-ids 3,16,28" in str(e.value)


def test_published_aux_ids_are_read_in_the_engines_layer_order(ref, ref_logits, inputs, tmp_path):
    source = write_speculators(ref, tmp_path / "spec", aux_ids=[27, 2, 15])
    model, record = finetune_model(train_config(source), inputs)
    assert model.config.aux_layer_ids == LAYER_IDS and torch.equal(probe_logits(model), ref_logits)
    assert any("[27, 2, 15] are not in layer order" in n for n in record["notes"])
    dup = write_speculators(ref, tmp_path / "dup", aux_ids=[2, 15, 15])
    with pytest.raises(Eagle3InputError, match=r"config\.json: .*\[2, 15, 15\] have duplicates"):
        finetune_model(train_config(dup), inputs)


def test_unsorted_aux_ids_in_our_checkpoint_are_refused_by_export(ref, tmp_path):
    run = write_ours(ref, tmp_path / "run")
    cfg = run / "final" / "draft_config.json"
    cfg.write_text(cfg.read_text().replace('"aux_layer_ids": [\n    2,\n    15,\n    27\n  ]',
                                           '"aux_layer_ids": [15, 2, 27]'))
    assert "[15, 2, 27]" in cfg.read_text()
    with pytest.raises(Eagle3InputError, match=r"draft_config\.json: .*\[15, 2, 27\] are not in increasing order"):
        export(run, tmp_path / "export", fmt="eagle", dtype="bfloat16")


def test_aux_layers_of_a_deeper_verifier_are_refused(ref, inputs, tmp_path):
    source = write_speculators(ref, tmp_path / "spec", aux_ids=[2, 30, 58])
    with pytest.raises(Eagle3InputError, match="only 30 layers"):
        finetune_model(train_config(source), inputs)


def test_config_that_does_not_describe_its_weights_is_refused(ref, inputs, tmp_path):
    source = write_speculators(ref, tmp_path / "spec")
    cfg_path = source / "config.json"
    cfg_path.write_text(cfg_path.read_text().replace('"intermediate_size": 1536', '"intermediate_size": 1024'))
    with pytest.raises(Eagle3InputError, match=r"mlp\.\w+_proj\.weight' has shape \[\d+, \d+\]"):
        finetune_model(train_config(source), inputs)


# --- broken files ---------------------------------------------------------------------------------------------------
def test_truncated_safetensors_fails_clearly(ref, inputs, tmp_path):
    source = write_speculators(ref, tmp_path / "spec")
    f = source / "model.safetensors"
    f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
    with pytest.raises(Eagle3InputError, match=r"model\.safetensors cannot be read \(corrupt or truncated\?\)"):
        finetune_model(train_config(source), inputs)


def test_truncated_pytorch_bin_fails_clearly(ref, inputs, tmp_path):
    source = write_eagle_original(ref, tmp_path / "eagle")
    f = source / "pytorch_model.bin"
    f.write_bytes(f.read_bytes()[:1000])
    with pytest.raises(Eagle3InputError, match=r"pytorch_model\.bin cannot be read"):
        finetune_model(train_config(source), inputs)


def test_sharded_checkpoint_with_a_missing_shard_fails_clearly(ref, inputs, tmp_path):
    source = write_sharded(ref, tmp_path / "sharded")
    (source / "model-00002-of-00003.safetensors").unlink()
    with pytest.raises(Eagle3InputError, match="model-00002-of-00003.safetensors listed by the index is missing"):
        finetune_model(train_config(source), inputs)


# --- missing and unknown tensors ------------------------------------------------------------------------------------
def test_missing_trainable_tensor_stops_unless_allowed(ref, inputs, tmp_path):
    source = write_speculators(ref, tmp_path / "spec", drop=("layers.0.mlp.down_proj.weight",))
    with pytest.raises(Eagle3InputError, match=r"lacks trainable tensors.*layers\.0\.mlp\.down_proj\.weight"):
        finetune_model(train_config(source), inputs)
    model, record = finetune_model(train_config(source, allow_missing=True), inputs)
    assert record["keys"]["missing"] == ["layers.0.mlp.down_proj.weight"]
    assert torch.equal(model.fc.weight, ref.fc.weight)
    assert not torch.equal(model.layers[0].mlp.down_proj.weight, ref.layers[0].mlp.down_proj.weight)


def test_unknown_tensor_is_never_dropped_silently(ref, ref_logits, inputs, tmp_path):
    extra = {"verifier_lm_head.weight": torch.randn(4, 576).to(torch.bfloat16),
             "layers.0.self_attn.rotary_emb.inv_freq": torch.ones(32)}
    source = write_speculators(ref, tmp_path / "spec", extra=extra)
    with pytest.raises(Eagle3InputError, match=r"no place for: \['verifier_lm_head.weight'\]"):
        finetune_model(train_config(source), inputs)
    model, record = finetune_model(train_config(source, allow_missing=True), inputs)
    assert set(record["keys"]["ignored"]) == set(extra)
    assert torch.equal(probe_logits(model), ref_logits)


def test_model_built_without_the_source_architecture_is_refused(head, vocab_a, inputs, tmp_path):
    ref = reference_draft(head[0], vocab_a, seed=3, **EAGLE31[0])
    cfg = train_config(write_speculators(ref, tmp_path / "spec"))
    plain = build_model(cfg, inputs)  # the run's settings, not the source's
    with pytest.raises(Eagle3InputError, match="norm_before_residual=False.*build_model"):
        apply_finetune_source(plain, cfg, inputs)


# --- vocabulary policies --------------------------------------------------------------------------------------------
def _overlapping_vocab(vocab_a, n_shared: int, size: int):
    a_ids = torch.nonzero(vocab_a[1]).flatten()
    shared = a_ids[torch.randperm(a_ids.numel(), generator=torch.Generator().manual_seed(9))[:n_shared]]
    fresh = torch.nonzero(~vocab_a[1]).flatten()
    fresh = fresh[torch.randperm(fresh.numel(), generator=torch.Generator().manual_seed(10))[: size - n_shared]]
    return vocab_from_ids(torch.cat([shared, fresh]))


def _ids(model) -> list[int]:
    return model.draft_token_ids().tolist()


def test_keep_uses_the_source_vocabulary_and_reports_the_overlap(ref, ref_logits, head, vocab_a, tmp_path):
    run_vocab = _overlapping_vocab(vocab_a, 700, 1500)
    inputs = make_inputs(tmp_path, head[0], head[1], run_vocab)
    model, record = finetune_model(train_config(write_speculators(ref, tmp_path / "spec")), inputs)
    assert model.config.draft_vocab_size == VD and torch.equal(model.d2t, ref.d2t)
    assert torch.equal(probe_logits(model), ref_logits)
    shared = len(set(_ids(ref)) & set((torch.arange(1500) + run_vocab[0]).tolist()))
    assert record["vocab_policy"] == "keep"
    assert record["vocab_overlap"]["shared_tokens"] == shared == 700
    assert record["vocab_overlap"]["share_of_run"] == round(700 / 1500, 4)
    # 47% of the run's tokens: warned and recorded (the source's vocabulary was built on other data)
    assert record["vocab_overlap"]["low_overlap_warning"] is True
    assert any("holds only 46.7% of the 1500 tokens" in n and "--finetune-vocab rebuild" in n for n in record["notes"])


@pytest.mark.parametrize("run_size", [VD, 1500])
def test_rebuild_remaps_lm_head_rows_by_token(run_size, ref, ref_logits, head, vocab_a, tmp_path):
    run_vocab = _overlapping_vocab(vocab_a, run_size // 2, run_size)
    inputs = make_inputs(tmp_path, head[0], head[1], run_vocab)
    model, record = finetune_model(
        train_config(write_speculators(ref, tmp_path / "spec"), finetune_vocab="rebuild"), inputs)
    assert model.config.draft_vocab_size == run_size and torch.equal(model.d2t, run_vocab[0])
    src_row = {t: i for i, t in enumerate(_ids(ref))}
    new_ids = _ids(model)
    shared = [(j, src_row[t]) for j, t in enumerate(new_ids) if t in src_row]
    fresh = [(j, t) for j, t in enumerate(new_ids) if t not in src_row]
    assert len(shared) == run_size // 2 == record["vocab_overlap"]["shared_tokens"]
    logits = probe_logits(model)
    rows_new, rows_src = zip(*shared)
    torch.testing.assert_close(logits[:, list(rows_new)], ref_logits[:, list(rows_src)], rtol=0, atol=0)
    rows_fresh, tokens_fresh = zip(*fresh)
    assert torch.equal(model.lm_head.weight[list(rows_fresh)], head[1][list(tokens_fresh)])
    if run_size == VD:  # replacing d2t/t2d without remapping rows (the SpecForge bug) changes shared predictions
        naive = reference_draft(head[0], vocab_a)
        naive.set_vocab(*run_vocab)
        naive_logits = probe_logits(naive)
        assert not torch.allclose(naive_logits[:, list(rows_new)], ref_logits[:, list(rows_src)])


def test_unknown_vocab_policy_is_refused(ref, inputs, tmp_path):
    with pytest.raises(Eagle3InputError, match="finetune_vocab"):
        load_finetune_source(train_config(write_speculators(ref, tmp_path / "s"), finetune_vocab="merge"), inputs)


# --- provenance -----------------------------------------------------------------------------------------------------
def test_a_chain_of_finetunes_can_be_traced_back(ref, inputs, tmp_path):
    cfg_a = train_config("", seed=3, out=str(tmp_path / "run-a"))
    meta_a = build_metadata(cfg_a, inputs, ref.config, {"method": "random", "seed": 3}, 1, started="t0",
                            status="finished", progress={"step": 100}, metrics={})
    run_a = write_ours(ref, tmp_path / "run-a", meta_a)
    model_b, init_b = finetune_model(train_config(run_a), inputs)
    meta_b = build_metadata(train_config(run_a, out=str(tmp_path / "run-b")), inputs, model_b.config, init_b, 1,
                            started="t1", status="finished", progress={"step": 50}, metrics={})
    save_checkpoint(tmp_path / "run-b" / "final", model_b, None, meta_b)
    _, init_c = finetune_model(train_config(tmp_path / "run-b"), inputs)
    assert init_c["source_metadata"]["init"]["source"] == str(run_a)
    assert init_c["source_metadata"]["init"]["source_metadata"]["init"] == {"method": "random", "seed": 3}
    assert init_c["resolved"] == str((tmp_path / "run-b" / "final").resolve())
    assert any("training run" in n for n in init_c["notes"])


def test_missing_source_path_is_reported(inputs):
    with pytest.raises(Eagle3InputError, match="not found"):
        finetune_model(train_config("./no/such/draft"), inputs)
