"""Settings dataclasses are the one source of every stage's YAML keys, CLI flags and Python defaults.

Fast: builds parsers and settings only (no model, no data).
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import inspect
import re
from pathlib import Path

import pytest
import yaml

from eagle3_train import __version__, settings
from eagle3_train.cli import SUBCOMMANDS, build_parser
from eagle3_train.cli import main as cli_main
from eagle3_train.pipeline import Pipeline
from eagle3_train.pipeline.config import merged_config
from eagle3_train.settings.train import TrainConfig
from eagle3_train.train.cli import config_from_args
from eagle3_train.utils.io import Eagle3InputError
from eagle3_train.utils.settings import build_settings, defaults, yaml_keys

REPO = Path(__file__).resolve().parents[2]

# command -> its settings dataclass (every stage that takes settings)
COMMANDS: dict[tuple[str, ...], type] = {
    ("prepare",): settings.PrepareSettings, ("generate",): settings.GenerateSettings,
    ("vocab",): settings.VocabSettings, ("extract",): settings.ExtractSettings, ("train",): TrainConfig,
    ("export",): settings.ExportSettings, ("evaluate", "offline"): settings.OfflineEvalSettings,
    ("evaluate", "served"): settings.ServedEvalSettings, ("serve",): settings.ServeSettings}
PARSERS = {**COMMANDS, ("run",): settings.RunSettings}


def stage_parser(command: tuple[str, ...]) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser()
    importlib.import_module(SUBCOMMANDS[command[0]][0]).add_arguments(p)
    for sub in command[1:]:
        action = next(a for a in p._actions if isinstance(a, argparse._SubParsersAction))
        p = action.choices[sub]
    return p


def options(p: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    return {a.dest: a for a in p._actions if a.dest not in ("help", "set", "config")}


@pytest.mark.parametrize("command", list(PARSERS), ids=" ".join)
def test_every_flag_default_and_choice_comes_from_the_dataclass(command):
    cls = PARSERS[command]
    p = stage_parser(command)
    opts = options(p)
    cli_fields = {f.name for f in dataclasses.fields(cls) if f.metadata.get("cli", True)}
    assert set(opts) == cli_fields  # every CLI setting is a flag, and every flag is a setting
    want = defaults(cls)
    for dest, action in opts.items():
        assert action.default == want[dest], f"{' '.join(command)} {action.option_strings}: default"
        assert action.help, f"{' '.join(command)} {action.option_strings} has no help"
        valid = settings_choices(cls, dest)
        if valid and action.choices is not None:
            assert tuple(action.choices) == valid
    assert "--set" in p._option_string_actions


def settings_choices(cls: type, name: str):
    from eagle3_train.utils.settings import choices

    return choices(cls, name)


def test_stage_modules_write_no_flag_defaults_of_their_own():
    for command in PARSERS:
        module = importlib.import_module(SUBCOMMANDS[command[0]][0])
        source = inspect.getsource(module.add_arguments)
        assert not re.search(r"default=(?!\[\])", source), \
            f"{module.__name__}.add_arguments sets a default: use the dataclass"


def test_every_pipeline_section_and_command_has_one_dataclass():
    assert list(settings.SECTIONS) == ["generate", "prepare", "vocab", "extract", "train", "select", "export",
                                       "evaluate"]
    for cls in [*settings.SECTIONS.values(), *settings.COMMANDS.values()]:
        assert dataclasses.is_dataclass(cls) and all(f.metadata.get("help") for f in dataclasses.fields(cls)), cls


def _api_defaults(fn, cls: type, renamed: dict[str, str] | None = None) -> list[tuple[str, object, object]]:
    """(parameter, its default, the dataclass default) for each keyword that is a setting."""
    want, renamed = defaults(cls), renamed or {}
    out = []
    for name, param in inspect.signature(fn).parameters.items():
        field = renamed.get(name, name)
        if field in want and param.default is not inspect.Parameter.empty and not isinstance(want[field], list):
            out.append((name, param.default, want[field]))
    return out


def test_python_api_defaults_are_the_dataclass_defaults():
    import torch

    from eagle3_train.data.prepare import prepare
    from eagle3_train.evaluate.offline import evaluate_offline
    from eagle3_train.evaluate.pipeline_eval import pipeline_evaluate
    from eagle3_train.export.exporter import export
    from eagle3_train.generate.regenerate import regenerate
    from eagle3_train.hidden_states.extract import extract
    from eagle3_train.vocab.build import build_vocab

    checks = [*_api_defaults(prepare, settings.PrepareSettings), *_api_defaults(build_vocab, settings.VocabSettings),
              *_api_defaults(regenerate, settings.GenerateSettings),
              *_api_defaults(extract, settings.ExtractSettings),
              *_api_defaults(export, settings.ExportSettings, {"fmt": "format"}),
              *_api_defaults(pipeline_evaluate, settings.EvaluateSettings),
              *_api_defaults(evaluate_offline, settings.OfflineEvalSettings)]
    assert len(checks) >= 35
    for name, got, want in checks:
        if isinstance(got, torch.dtype):
            got = str(got).removeprefix("torch.")
        assert got == want, name
    assert inspect.signature(extract).parameters["splits"].default is None  # None = ExtractSettings().splits


# --- mistyped keys -----------------------------------------------------------------------------------------------
def _typo(key: str) -> str:
    """Two neighbouring letters swapped (the commonest typing slip)."""
    return key[0] + key[2] + key[1] + key[3:] if len(key) > 2 else key + "x"


@pytest.mark.parametrize("section", list(settings.SECTIONS))
def test_mistyped_key_in_each_yaml_section_names_the_closest_key(section):
    cls = settings.SECTIONS[section]
    for key in yaml_keys(cls):
        typo = _typo(key)
        if typo in yaml_keys(cls):
            continue
        with pytest.raises(Eagle3InputError) as e:
            Pipeline({section: {typo: 1}, "run_dir": "/nonexistent/never-created"})
        msg = str(e.value)
        assert "\n" not in msg and f"'{section}'" in msg and f"'{typo}'" in msg, msg
        assert f"did you mean '{key}'" in msg, msg


def test_mistyped_top_level_key_and_pipeline_only_keys():
    with pytest.raises(Eagle3InputError, match="unknown key 'trian' .*did you mean 'train'"):
        merged_config({"trian": {}})
    with pytest.raises(Eagle3InputError, match="did you mean 'run_dir'"):
        merged_config({"run_dri": "x"})
    with pytest.raises(Eagle3InputError, match="unknown key 'out' in config section 'prepare'"):
        merged_config({"prepare": {"out": "x"}})  # paths between stages are the pipeline's


def test_bad_values_in_yaml_are_named():
    with pytest.raises(Eagle3InputError, match="section 'prepare': 'max_length' must be int"):
        merged_config({"prepare": {"max_length": "long"}})
    with pytest.raises(Eagle3InputError, match=r"'overflow' must be one of \['truncate', 'drop'\]"):
        merged_config({"prepare": {"overflow": "wrap"}})
    with pytest.raises(Eagle3InputError, match="'finetune_vocab' must be one of"):
        merged_config({"train": {"finetune_vocab": "bogus"}})
    with pytest.raises(Eagle3InputError, match="'formats' must be one of"):
        merged_config({"export": {"formats": ["eagle", "gguf"]}})
    cfg = merged_config({"train": {"lr": "3e-4"}, "evaluate": {"vllm": "auto"}})  # YAML 1.1 reads 3e-4 as a string
    assert cfg["train"]["lr"] == 3e-4 and cfg["evaluate"]["vllm"] == "auto"


def test_run_set_typo_is_one_line_before_anything_runs(tmp_path, capsys):
    cfg = tmp_path / "c.yaml"
    cfg.write_text(yaml.safe_dump({"run_dir": str(tmp_path / "run")}))
    assert cli_main(["run", "--config", str(cfg), "--set", "train.lrr=1"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "'lrr'" in err and "did you mean 'lr'" in err and "'train'" in err
    assert cli_main(["run", "--config", str(cfg), "--run-dir", str(tmp_path / "other"), "--set",
                     "prepare.max_lenght=8"]) == 2
    assert "did you mean 'max_length'" in capsys.readouterr().err
    assert not (tmp_path / "run").exists() and not (tmp_path / "other").exists()


@pytest.mark.parametrize("command", list(COMMANDS), ids=" ".join)
def test_stage_set_typo_is_one_line_naming_the_closest_key(command, capsys):
    cls = COMMANDS[command]
    key = next(k for k in yaml_keys(cls) if len(k) > 3 and _typo(k) not in defaults(cls)) \
        if yaml_keys(cls) else "overwrite"
    required = [a for f in dataclasses.fields(cls) if f.metadata.get("required") or f.metadata.get("positional")
                for a in (["x"] if f.metadata.get("positional") else [f"--{f.name.replace('_', '-')}", "x"])]
    assert cli_main([*command, *required, "--set", f"{_typo(key)}=1"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and f"did you mean '{key}'" in err, err


# --- --set syntax and precedence -----------------------------------------------------------------------------------
def _train_args(*argv: str) -> argparse.Namespace:
    argv = ("train", *argv)
    return build_parser(list(argv)).parse_args(list(argv))


def test_train_set_bare_key_really_sets_lr():
    assert config_from_args(_train_args("--set", "lr=3e-4")).lr == 3e-4  # was silently ignored
    assert config_from_args(_train_args("--set", "train.lr=3e-4")).lr == 3e-4
    assert config_from_args(_train_args()).lr == TrainConfig.lr
    with pytest.raises(Eagle3InputError, match="section 'prepare' is not one of"):
        config_from_args(_train_args("--set", "prepare.max_length=4"))


def test_train_precedence_yaml_then_set_then_flags(tmp_path):
    cfg = tmp_path / "c.yaml"
    cfg.write_text(yaml.safe_dump({"train": {"lr": 0.002, "epochs": 3, "ttt_steps": 2}}))
    c = config_from_args(_train_args("--config", str(cfg), "--set", "lr=3e-4", "--epochs", "1"))
    assert (c.lr, c.epochs, c.ttt_steps) == (3e-4, 1.0, 2)
    c = config_from_args(_train_args("--config", str(cfg), "--set", "lr=3e-4", "--lr", "0.01"))
    assert c.lr == 0.01
    cfg.write_text(yaml.safe_dump({"train": {"lrr": 1}}))
    with pytest.raises(Eagle3InputError, match="did you mean 'lr'"):
        config_from_args(_train_args("--config", str(cfg)))


@pytest.mark.parametrize("argv", [
    ["train", "--finetune-vocab", "bogus"], ["train", "--precision", "fp16"], ["prepare", "--out", "o", "--overflow",
                                                                             "wrap"],
    ["export", "ckpt", "--out", "o", "--weight-dtype", "int8"], ["extract", "--prepared", "p", "--out", "o",
                                                                 "--store-dtype", "fp8"],
    ["evaluate", "offline", "--draft", "d", "--turns", "3"], ["evaluate", "offline", "--draft", "d", "--dtype", "x"],
    ["generate", "--out", "o", "--reasoning", "think"], ["serve", "--server-dtype", "int4"],
    ["train", "--lr", "fast"]], ids=lambda a: " ".join(a[:3]))
def test_parser_rejects_bad_choices_before_any_input_loads(argv, capsys):
    with pytest.raises(SystemExit) as e:
        cli_main(argv)
    assert e.value.code == 2 and "invalid" in capsys.readouterr().err


@pytest.mark.parametrize("argv, message", [
    (["train", "--epochs", "0"], "epochs must be > 0, got 0.0"),
    (["train", "--epochs", "-1"], "epochs must be > 0"),
    (["train", "--token-budget", "0"], "token_budget must be >= 1"),
    (["train", "--num-layers", "0"], "num_layers must be >= 1"),
    (["train", "--step-decay", "-1"], "step_decay must be (0, 1]"),
    (["train", "--step-decay", "1e308"], "step_decay must be (0, 1], got 1e+308"),
    (["train", "--lr", "-1"], "lr must be >= 0"),
    (["train", "--lr", "nan"], "lr must be a finite number >= 0, got nan"),
    (["train", "--lr", "inf"], "lr must be a finite number >= 0, got inf"),
    (["train", "--set", "train.lr=.inf"], "lr must be a finite number >= 0, got inf"),
    (["train", "--noise", "inf"], "noise must be a finite number >= 0, got inf"),
    (["train", "--set", "train.grad_clip=-.inf"], "grad_clip must be a finite number >= 0, got -inf"),
    (["train", "--ttt-steps", "0"], "ttt_steps must be >= 1"),
    (["train", "--log-every", "0"], "log_every must be >= 1"),
    (["train", "--grad-accum", "0"], "grad_accum must be >= 1"),
    (["train", "--set", "train.beta2=1.0"], "beta2 must be [0, 1)"),
    (["export", "ckpt", "--out", "o", "-k", "0"], "speculative_tokens must be >= 1"),
    (["generate", "--data", "sharegpt", "--out", "o", "--top-p", "0"], "top_p must be (0, 1]"),
], ids=lambda a: " ".join(a) if isinstance(a, list) else "")
def test_settings_out_of_range_stop_before_anything_runs(argv, message, capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert cli_main(argv) == 2
    assert message in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []  # nothing was written


def test_the_python_api_checks_the_same_ranges():
    from eagle3_train.settings.train import TrainConfig

    with pytest.raises(Eagle3InputError, match=r"train.step_decay must be \(0, 1\], got -1"):
        TrainConfig(step_decay=-1)
    TrainConfig(step_decay=0.5, keep_last=0, max_steps=None)  # in range, and None where allowed


def test_val_count_that_leaves_almost_nothing_to_train_is_refused():
    from eagle3_train.data.split import assign_splits

    with pytest.raises(Eagle3InputError, match="val_count 100 is not smaller than the 6 conversations"):
        assign_splits([f"c{i}" for i in range(6)], 0.05, 0, val_count=100)
    assert assign_splits([f"c{i}" for i in range(6)], 0.05, 0, val_count=2).count("validation") == 2


def test_one_name_for_one_thing():
    def parse(*argv: str) -> argparse.Namespace:
        return build_parser(list(argv)).parse_args(list(argv))

    # prompt count and draft length: one name, old spellings kept as aliases
    for mode in ("offline", "served"):
        extra = ["--draft", "d"] if mode == "offline" else []
        for flag in ("--num-prompts", "--limit"):
            assert parse("evaluate", mode, *extra, flag, "2").num_prompts == 2
        for flag in ("-k", "--num-speculative-tokens", "--speculative-tokens"):
            assert parse("evaluate", mode, *extra, flag, "5").k == 5
        for flag in ("--benchmark", "--prompts"):
            assert parse("evaluate", mode, *extra, flag, "humaneval").benchmark == "humaneval"
        for flag in ("--max-tokens", "--max-new-tokens"):
            a = parse("evaluate", mode, *extra, flag, "7")
            assert (a.max_new_tokens if mode == "offline" else a.max_tokens) == 7
    for flag in ("-k", "--num-speculative-tokens", "--speculative-tokens"):
        assert parse("export", "c", "--out", "o", flag, "5").speculative_tokens == 5
        assert parse("serve", flag, "5").k == 5
    # each dtype has a name saying what it is; --dtype still works
    assert parse("extract", "--prepared", "p", "--out", "o", "--store-dtype", "float32").dtype == "float32"
    assert parse("extract", "--prepared", "p", "--out", "o", "--dtype", "float32").dtype == "float32"
    assert parse("export", "c", "--out", "o", "--weight-dtype", "float16").dtype == "float16"
    assert parse("evaluate", "offline", "--draft", "d", "--compute-dtype", "bfloat16").dtype == "bfloat16"
    assert parse("serve", "--server-dtype", "bfloat16").dtype == "bfloat16"
    # repeatable endpoints (also comma-separated) in generate and evaluate served
    a = parse("evaluate", "served", "--endpoint", "http://a/v1", "--endpoint", "http://b/v1,http://c/v1")
    assert a.endpoint == ["http://a/v1", "http://b/v1", "http://c/v1"]
    assert parse("generate", "--data", "d", "--out", "o", "--endpoint", "http://a/v1").endpoint == ["http://a/v1"]
    # --overwrite on every stage that writes one output directory
    for argv in (["generate", "--data", "d", "--out", "o"], ["extract", "--prepared", "p", "--out", "o"],
                 ["vocab", "--prepared", "p", "--out", "o"], ["export", "c", "--out", "o"], ["train"]):
        assert parse(*argv).overwrite is False and parse(*argv, "--overwrite").overwrite is True


def test_extract_splits_are_a_list():
    argv = ["extract", "--prepared", "p", "--out", "o", "--splits", "train"]
    from eagle3_train.utils.settings import settings_from_args

    s = settings_from_args(settings.ExtractSettings, build_parser(argv).parse_args(argv))
    assert s.splits == ["train"]
    assert build_settings(settings.ExtractSettings, {"splits": "train,validation"}, "x").splits == \
        ["train", "validation"]


# --- docs and version ------------------------------------------------------------------------------------------
def test_config_reference_is_up_to_date():
    committed = (REPO / "docs" / "CONFIG.md").read_text()
    assert committed == settings.config_reference(), \
        "docs/CONFIG.md is stale: python -m eagle3_train.settings --markdown > docs/CONFIG.md"
    for name, cls in settings.SECTIONS.items():
        assert f"## `{name}`" in committed
        for key in yaml_keys(cls):
            assert f"| `{key}` |" in committed


def test_train_core_stays_small_and_experimental_settings_are_listed_apart():
    """TrainConfig's core (what is not marked experimental) stays at most 64 settings; the experimental ones are a
    table of their own in docs/CONFIG.md and say so in their flag's help."""
    from eagle3_train.utils.settings import core_fields, is_experimental

    experimental = [f.name for f in dataclasses.fields(TrainConfig) if is_experimental(f)]
    # 61st: report_to, 62nd: early_stop, 63rd: optimizer (Muon became the default), 64th: method (P-EAGLE)
    assert len(core_fields(TrainConfig)) <= 64, len(core_fields(TrainConfig))
    assert set(experimental) == {"loss", "loss_mix", "muon_lr", "muon_momentum", "muon_weight_decay",
                                 "hidden_size", "offload_optimizer", "mask_token_id"}
    committed = (REPO / "docs" / "CONFIG.md").read_text()
    section = committed.split("## `train`", 1)[1].split("\n## ", 1)[0]
    core, corner = section.split("### `train`: experimental", 1)
    assert "Experimental:" in corner
    for name in experimental:
        assert f"| `{name}` |" in corner and f"| `{name}` |" not in core
    assert "| `lr` |" in core and "| `lr` |" not in corner
    helps = {a.dest: a.help for a in stage_parser(("train",))._actions}
    assert helps["muon_lr"].startswith("experimental: ") and not helps["optimizer"].startswith("experimental")


@pytest.mark.parametrize("key", sorted(TrainConfig.RETIRED))
def test_a_retired_train_option_is_an_error_naming_it(key, tmp_path):
    value = TrainConfig.RETIRED[key]
    with pytest.raises(Eagle3InputError) as e:
        merged_config({"train": {key: value}})
    msg = str(e.value)
    assert f"unknown key '{key}'" in msg and "retired" in msg and "benchmarks/LOG.md" in msg and "\n" not in msg
    with pytest.raises(Eagle3InputError, match=f"unknown key '{key}'.*retired"):
        config_from_args(_train_args("--set", f"{key}={value}"))
    cfg = tmp_path / "c.yaml"
    cfg.write_text(yaml.safe_dump({"train": {key: value}}))
    with pytest.raises(Eagle3InputError, match=f"unknown key '{key}'.*retired"):
        config_from_args(_train_args("--config", str(cfg)))
    with pytest.raises(TypeError, match=key):
        TrainConfig(**{key: value})


def test_a_checkpoint_saved_with_a_retired_option_resumes_only_at_its_old_default():
    now = TrainConfig()
    saved = {**now.to_dict(), **TrainConfig.RETIRED}  # a checkpoint of the version before the retirement
    assert now.resume_conflicts(saved) == []
    inert = {**saved, "layer_init_index": 3, "layer_init_embed": "verifier"}  # read only under layer_init verifier
    assert now.resume_conflicts(inert) == []
    for key, value in {"chain_mask": True, "feature_loss": 1.0, "equalise_features": True, "layer_init": "verifier",
                       "target_temperature": 0.0}.items():
        conflicts = now.resume_conflicts({**saved, key: value})
        assert len(conflicts) == 1 and conflicts[0].startswith(f"{key} {value!r}: a retired option"), conflicts
    both = now.resume_conflicts({**saved, "layer_init": "verifier", "layer_init_index": 3})
    assert [c.split()[0] for c in both] == ["layer_init", "layer_init_index"]


def test_every_key_of_the_shipped_config_is_valid():
    for path in sorted((REPO / "configs").glob("*.yaml")):
        merged_config(yaml.safe_load(path.read_text()))


def test_version(capsys):
    with pytest.raises(SystemExit) as e:
        cli_main(["--version"])
    assert e.value.code == 0 and capsys.readouterr().out.strip() == f"eagle3-train {__version__}"


def test_a_key_given_twice_in_a_run_config_is_refused(tmp_path, capsys):
    """PyYAML keeps the last of two equal keys without a word: a config whose second `lr` was meant to replace the
    first, or a paste that doubled a section, must say so."""
    config = tmp_path / "c.yaml"
    config.write_text(f"run_dir: {tmp_path / 'run'}\ntrain:\n  lr: 1e-4\n  epochs: 2\n  lr: 3e-4\n")
    assert cli_main(["run", "--config", str(config), "--dry-run"]) == 2
    assert "key 'lr' is given twice (lines 3 and 5)" in capsys.readouterr().err


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="a CUDA machine has the device")
def test_a_cuda_device_on_a_machine_without_one_is_a_clear_error_everywhere(tmp_path, capsys):
    assert cli_main(["train", "--prepared", "p", "--hidden-states", "h", "--vocab", "v", "--out", str(tmp_path / "o"),
                     "--device", "cuda"]) == 2
    assert "--device cuda was requested but torch sees no CUDA device" in capsys.readouterr().err
    config = tmp_path / "c.yaml"
    config.write_text(f"run_dir: {tmp_path / 'run'}\ntrain:\n  device: cuda:1\n")
    assert cli_main(["run", "--config", str(config), "--dry-run"]) == 2
    assert "train.device cuda:1 was requested but torch sees no CUDA device" in capsys.readouterr().err
    assert not (tmp_path / "run").exists() and not (tmp_path / "o").exists()


def test_a_config_string_for_a_list_whose_items_may_hold_commas_is_one_item():
    """`prepare.data: "chats,v2.jsonl"` is one file, not two sources; a comma list field still splits."""
    from eagle3_train.settings import PrepareSettings
    from eagle3_train.utils.settings import build_settings, parse_set

    s = build_settings(PrepareSettings, {"data": "chats,v2.jsonl", "verifier": "v", "out": "o"}, "section 'prepare'")
    assert s.data == ["chats,v2.jsonl"]
    assert parse_set(["data=a,b.jsonl"], PrepareSettings) == {"data": ["a,b.jsonl"]}
    assert parse_set(["splits=train,validation"], settings.ExtractSettings)["splits"] == ["train", "validation"]

