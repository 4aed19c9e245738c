"""Names and messages (issue 35, item 4): the spellings users bring from speculators, SpecForge and HF Trainer, and
the underscore form of every flag, are accepted; a mistyped flag or key names the one meant (an ecosystem name
first, then the nearest by edits) in one line; the answers a new user found poor are each a clear one now.

The messages come from the real CLI (`eagle3-train ...` as `cli.main`), the parsers from `cli.build_parser`."""

from __future__ import annotations

import argparse
import json
import shutil

import pytest
import yaml

from eagle3_train.cli import SUBCOMMANDS, build_parser
from eagle3_train.cli import main as cli_main
from eagle3_train.evaluate.report import format_table
from eagle3_train.pipeline.summary import format_summary
from eagle3_train.train.cli import config_from_args


def stage_parsers():
    """(command, parser) of every stage and mode, as the CLI builds them."""
    for stage in SUBCOMMANDS:
        top = build_parser([stage])
        parser = next(a for a in top._actions if isinstance(a, argparse._SubParsersAction)).choices[stage]
        modes = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
        if modes:
            yield from ((f"{stage} {m}", p) for m, p in modes[0].choices.items())
        else:
            yield stage, parser


def parse(*argv: str) -> argparse.Namespace:
    return build_parser(list(argv)).parse_args(list(argv))


def error_of(argv: list[str], capsys) -> str:
    """The one line a refused command prints; argparse's exit status 2 (or the CLI's)."""
    try:
        rc = cli_main(argv)
    except SystemExit as e:
        rc = e.code
    err = capsys.readouterr().err.strip()
    assert rc == 2 and err.count("\n") == 0, (rc, err)
    return err


# --- other spellings ---------------------------------------------------------------------------------------------
def test_the_ecosystem_names_and_underscores_are_our_flags():
    c = config_from_args(parse("train", "--learning-rate", "3e-4", "--num-epochs", "2", "--output-dir", "runs/x",
                               "--ttt_steps", "3", "--gradient_accumulation_steps", "4", "--max-grad-norm=0.25",
                               "--warmup_ratio", "0.1", "--no_tensorboard", "--ttt-length", "5"))
    assert (c.lr, c.epochs, c.out, c.grad_accum, c.grad_clip, c.warmup_ratio, c.tensorboard) == \
        (3e-4, 2.0, "runs/x", 4, 0.25, 0.1, False)
    assert c.ttt_steps == 5  # the later flag wins, whatever its spelling
    assert config_from_args(parse("train", "--num-train-epochs", "3", "--ttt_step", "2")).epochs == 3.0
    assert config_from_args(parse("train", "--ttt_step", "2")).ttt_steps == 2  # an abbreviation, underscored
    # the CLI's -v after the stage too, without undoing it before the stage
    assert parse("train", "-v").verbose and parse("-v", "train").verbose and not parse("train").verbose


def test_a_required_flag_counts_as_given_under_another_name():
    args = parse("prepare", "--output-dir", "o", "--model-name-or-path", "v", "--max-seq-length", "512")
    assert (args.out, args.verifier, args.max_length) == ("o", "v", 512)
    assert parse("export", "ckpt", "--output", "o", "--weight_dtype", "float16").out == "o"
    assert parse("run", "--config", "c.yaml", "--output-dir", "r").run_dir == "r"


def test_every_flag_of_every_stage_takes_its_underscore_form():
    checked = 0
    for command, parser in stage_parsers():
        for flag in (o for o in parser._option_string_actions if o.startswith("--") and "-" in o[2:]):
            underscored = "--" + flag[2:].replace("-", "_")
            assert parser.respell([underscored, "x"])[0] == flag, (command, flag)
            checked += 1
    assert checked > 150


def test_plan_takes_underscores_and_ecosystem_names_too(tmp_path, capsys):
    verifier = tmp_path / "v"
    verifier.mkdir()
    (verifier / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 256, "num_hidden_layers": 4,
        "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 512, "vocab_size": 4096,
        "max_position_embeddings": 2048, "rms_norm_eps": 1e-5, "tie_word_embeddings": False}))
    assert cli_main(["plan", "--verifier", str(verifier), "--samples", "100", "--tokens_per_sample", "512",
                     "--ttt_steps", "3", "--num-epochs", "2", "--gradient-accumulation-steps", "2", "--json"]) == 0
    settings = json.loads(capsys.readouterr().out)["settings"]
    assert (settings["tokens_per_sample"], settings["ttt_steps"], settings["epochs"], settings["grad_accum"]) == \
        (512, 3, 2.0, 2)


def test_help_lists_each_setting_once_and_names_the_other_spellings(capsys):
    with pytest.raises(SystemExit):
        cli_main(["train", "--help"])
    out = capsys.readouterr().out
    options, note = out.split("Every flag also takes underscores")
    assert "--lr LR" in options and "--learning-rate" not in options
    assert "--learning-rate for --lr" in " ".join(note.split()) and "--num-epochs, --num-train-epochs for --epochs" \
        in " ".join(note.split())


def test_what_follows_double_dash_is_the_launched_stages(capsys):
    """launch's `-- STAGE FLAGS...` is passed on as written (the launched stage reads its own spellings)."""
    assert cli_main(["launch", "--nodes", "2", "--gpus_per_node", "1", "--head", "h", "--", "train",
                     "--learning_rate", "1e-4"]) == 0
    assert "--learning_rate 1e-4" in capsys.readouterr().out


# --- near-misses -------------------------------------------------------------------------------------------------
UNKNOWN = [
    (["train", "--learnig-rate", "1e-4"], "eagle3-train train: error: unknown flag --learnig-rate; did you mean --lr?"),
    (["train", "--ttt-step-s", "3"], "unknown flag --ttt-step-s; did you mean --ttt-steps?"),
    (["train", "--batch-size", "8"], "unknown flag --batch-size; did you mean --token-budget? (padded tokens per "
                                     "micro-batch, not a number of samples)"),
    # before argparse's check of the required flags (--verifier is missing too)
    (["prepare", "--outdir", "o"], "eagle3-train prepare: error: unknown flag --outdir; did you mean --out?"),
    (["evaluate", "offline", "--draftt=d"], "eagle3-train evaluate offline: error: unknown flag --draftt; did you "
                                            "mean --draft?"),
    (["export", "ckpt", "--out", "o", "--format", "eagle", "--bogus-thing"], "unknown flag --bogus-thing; see "
                                                                             "eagle3-train export --help"),
    (["train", "extra"], "eagle3-train train: error: unexpected argument extra"),
    (["serve", "--vllm-arg", "--max-num-seqs=4"], "unknown flag --max-num-seqs; see eagle3-train serve --help; if it "
                                                  "is the value of --vllm-arg, write --vllm-arg=--max-num-seqs=4"),
    (["train", "--feature_noise", "0.1"], "unknown flag --feature_noise: 'feature_noise' was retired after it measured "
                                          "no gain (benchmarks/LOG.md"),
    (["trian", "--lr", "1"], "eagle3-train: error: unknown command 'trian'; did you mean 'train'?"),
]


@pytest.mark.parametrize("argv, line", UNKNOWN, ids=[" ".join(argv) for argv, _ in UNKNOWN])
def test_an_unknown_flag_is_one_line_naming_the_one_meant(argv, line, capsys):
    assert line in error_of(argv, capsys)


def test_a_mistyped_set_key_ranks_the_ecosystem_name_before_edit_distance(capsys):
    err = error_of(["train", "--set", "train.learnig_rate=1e-4"], capsys)
    assert "unknown key 'learnig_rate'" in err and "did you mean 'lr'?" in err and "warmup_ratio" not in err
    assert "did you mean 'token_budget'? (padded tokens per micro-batch" in error_of(
        ["train", "--set", "per_device_train_batch_size=4"], capsys)


def test_a_config_key_is_our_name_and_the_ecosystems_is_refused_naming_it(tmp_path, capsys):
    config = tmp_path / "c.yaml"
    config.write_text(yaml.safe_dump({"run_dir": str(tmp_path / "run"), "train": {"learning_rate": 1e-4}}))
    err = error_of(["run", "--config", str(config), "--dry-run"], capsys)
    assert "unknown key 'learning_rate'" in err and "did you mean 'lr'?" in err and "flags accept it" in err
    assert not (tmp_path / "run").exists()


# --- the answers a new user found poor ---------------------------------------------------------------------------
def test_a_verifier_without_a_chat_template_names_the_flag_that_gives_one(smollm2_dir, tmp_path, capsys):
    verifier = tmp_path / "verifier"
    verifier.mkdir()
    for name in ("config.json", "tokenizer.json", "special_tokens_map.json"):
        if (smollm2_dir / name).is_file():
            shutil.copy2(smollm2_dir / name, verifier / name)
    tokenizer_config = json.loads((smollm2_dir / "tokenizer_config.json").read_text())
    tokenizer_config.pop("chat_template", None)
    (verifier / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))
    err = error_of(["prepare", "--data", "sharegpt", "--verifier", str(verifier), "--out", str(tmp_path / "p"),
                    "--limit", "2"], capsys)
    assert "has no chat template" in err and "--chat-template FILE.jinja" in err and "prepare.chat_template" in err


def test_an_export_source_says_what_was_looked_for_and_what_to_pass(tmp_path, capsys):
    out = str(tmp_path / "export")
    err = error_of(["export", str(tmp_path / "missing"), "--out", out], capsys)
    assert f"{tmp_path / 'missing'} does not exist" in err
    assert "a training run directory (its final/ checkpoint" in err and "draft_config.json and model.safetensors" in err
    (tmp_path / "empty").mkdir()
    err = error_of(["export", str(tmp_path / "empty"), "--out", out], capsys)
    assert "does not exist" not in err and f"found none of {tmp_path / 'empty' / 'draft_config.json'}" in err
    assert "checkpoints/latest.json" in err and "pass a training run directory" in err
    published = tmp_path / "published"
    published.mkdir()
    (published / "config.json").write_text("{}")
    assert "an exported or published draft" in error_of(["export", str(published), "--out", out], capsys)
    assert not (tmp_path / "export").exists()


def test_the_run_summary_is_a_short_rounded_table(tmp_path):
    counts = {"conversations_read": 1200, "kept": {"train": 1103, "validation": 58}, "truncated": 7,
              "skipped_total": 39, "skipped": {"no_assistant_turn": 39}, "duplicates_dropped": 0,
              "bad_records": {}, "tokens": {"train": 912345, "validation": 40110},
              "supervised_tokens": {"train": 501234, "validation": 21000}, "max_length_seen": 2048,
              "generated_ids": {"compared": 0, "note": "x" * 300}}
    summary = {"data": {"counts": counts},
               "extract": {"throughput": {"tokens_per_s": 12345.6789, "processes": 2, "device": "cpu",
                                          "compute_dtype": "float32", "seconds": 77.123456789}},
               "train": {"tokens_per_s": 5432.10987, "steps": 12,
                         "validation": {"accept_len_k1": 1.1234567, "accept_len_k3": 1.401234, "loss": 3.2}},
               "evaluate": {"vllm_eagle": {"mean_acceptance_length": 1.40567891}, "vllm_skipped": "no vLLM here"},
               "exports": {"eagle": "runs/x/export-eagle"}}
    text = format_summary(summary, tmp_path / "summary.json")
    rows = dict(line.split("  ", 1) for line in text.splitlines() if "  " in line)
    rows = {k.strip(): v.strip() for k, v in rows.items()}
    assert rows["data"] == "1,103 train + 58 validation samples; 952,455 tokens (522,234 supervised); 7 truncated, " \
                           "39 skipped"
    assert rows["extract"] == "12,346 tokens/s over 2 processes (cpu, float32)"
    assert rows["training tokens/s"] == "5,432"
    assert rows["estimated acceptance length (validation)"] == "k=1 1.123, k=3 1.401"
    assert rows["acceptance length: vllm_eagle"] == "1.406" and rows["vLLM evaluation skipped"] == "no vLLM here"
    assert rows["every figure in full"] == str(tmp_path / "summary.json")
    assert "{" not in text and '"' not in text and "xxx" not in text
    assert format_summary({}).count("data") == 1  # a summary without data still prints


def test_the_evaluate_report_rounds_and_never_dumps_json():
    mismatches = [{"prompt": f"p{i}", "turn": 1, "position": 4 + i, "full_forward_logit_gap": 0.000123456 * (i + 1),
                   "greedy_top2_margin": 0.01, "near_tie": True, "spec_len": 40, "greedy_len": 40} for i in range(7)]
    offline = {"benchmarks": {"mt-bench": {"num_drafts": 812, "mean_acceptance_length": 1.4056789,
                                           "per_position_acceptance": [0.31234567, 0.0812345],
                                           "tokens_per_verifier_forward": 1.3987654, "tokens_per_s": 12345.6789}},
               "greedy_check": {"checked": True, "passed": False, "mismatches": mismatches}}
    table = format_table(offline)
    assert "1.406" in table and "0.312" in table and "12,346" in table and "12345.6" not in table
    greedy = next(line for line in table.splitlines() if line.startswith("greedy check"))
    assert greedy == ("greedy check: 7 near-tie difference(s): prompt p0 turn 1 at new token 4 (logit gap 1.23e-04), "
                      "prompt p1 turn 1 at new token 5 (logit gap 2.47e-04), prompt p2 turn 1 at new token 6 (logit "
                      "gap 3.70e-04) and 4 more (results.json)")
    served = {"mode": "served", "benchmarks": ["mt-bench"], "tokens_per_s": 98.76543,
              "acceptance": {"num_drafts": 10, "mean_acceptance_length": 2.1, "per_position_acceptance": [0.6]},
              "greedy_identical": {"identical": 72, "compared": 80, "differing_ids": [f"q{i}" for i in range(8)]}}
    table = format_table(served)
    assert "98.77" in table and "{" not in table
    assert "greedy outputs vs baseline: 72 of 80 identical; differing: q0, q1, q2, q3, q4 and 3 more (results.json)" \
        in table


@pytest.mark.parametrize("key", ["original_answers=true", "enabled=true"])
def test_generate_refuses_a_run_only_key_instead_of_ignoring_it(key, tmp_path, capsys):
    out = tmp_path / "gen"
    rc = cli_main(["generate", "--data", "sharegpt", "--out", str(out), "--endpoint", "http://127.0.0.1:9/v1",
                   "--set", key])
    err = capsys.readouterr().err
    assert rc == 2 and key.split("=")[0] in err and "eagle3-train run" in err, err
    assert not out.exists()


def test_generate_cuts_max_turns_into_the_tool_cache_once(tmp_path, monkeypatch):
    """`generate --set max_turns=N` regenerates the first N user turns, as the run's generate stage does."""
    from eagle3_train.generate.first_turns import cut_turns_cached

    monkeypatch.setenv("EAGLE3_TRAIN_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv("EAGLE3_TRAIN_DATA_CACHE", raising=False)
    src = tmp_path / "chats.jsonl"
    turns = [{"role": r, "content": f"{r} {i}"} for i in range(3) for r in ("user", "assistant")]
    src.write_text(json.dumps({"id": "c", "messages": turns}) + "\n")
    first = cut_turns_cached(str(src), None, 2, False)
    assert first.is_relative_to(tmp_path / "cache")
    (kept,) = [json.loads(line) for line in first.read_text().splitlines()]
    assert [m["content"] for m in kept["messages"]] == ["user 0", "assistant 0", "user 1", "assistant 1"]
    assert cut_turns_cached(str(src), None, 2, False) == first and cut_turns_cached(str(src), None, 1, False) != first
