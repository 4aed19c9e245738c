"""Set-up scripts: a failed pip step stops set-up with pip's own error (scripts/pipq.sh), harmless noise is dropped."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def run_with_pipq(commands: str) -> subprocess.CompletedProcess:
    """`commands` in bash with the set-up scripts' options and pipq, as scripts/setup.sh runs them."""
    script = f"set -euo pipefail\nsource scripts/pipq.sh\n{commands}\necho SET-UP-CONTINUED\n"
    return subprocess.run(["bash", "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=300)


def test_a_failed_install_stops_setup_with_pips_error():
    bogus = "eagle3-train-no-such-package-x9"
    r = run_with_pipq(f"pipq {sys.executable} -m pip install --no-index {bogus}")
    assert r.returncode != 0
    assert "SET-UP-CONTINUED" not in r.stdout
    assert "ERROR:" in r.stdout and bogus in r.stdout  # pip's own message reaches the user


def test_pipq_drops_location_warnings_and_keeps_the_rest():
    fake_pip = "bash -c 'echo \"WARNING: Location foo\"; echo \"kept line\" >&2; exit 0' fake-pip"
    r = run_with_pipq(f"pipq {fake_pip}")
    assert r.returncode == 0 and "SET-UP-CONTINUED" in r.stdout
    assert "kept line" in r.stdout and "WARNING: Location" not in r.stdout + r.stderr
    r = run_with_pipq("pipq bash -c 'echo \"WARNING: Location foo\"; exit 3' fake-pip")
    assert r.returncode == 3 and "SET-UP-CONTINUED" not in r.stdout


def test_setup_scripts_use_pipq_for_every_pip_install():
    for name in ("setup.sh",):  # setup_vllm.sh runs serving/vllm_env.py, whose pip calls filter the same lines
        text = (ROOT / "scripts" / name).read_text()
        assert "source scripts/pipq.sh" in text, name
        for line in text.splitlines():
            if "pip install" in line:
                assert line.lstrip().startswith(("pipq ", "if ")) and "|| true" not in line, (name, line)


def test_an_interrupted_venv_is_repaired(tmp_path):
    """`python -m venv` killed before pip was installed leaves python without pip; set-up repairs it."""
    broken = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(broken)], check=True)
    assert (broken / "bin" / "python").exists() and not (broken / "bin" / "pip").exists()
    r = subprocess.run(["bash", "-c", f"source scripts/pipq.sh && ensure_venv {sys.executable} {broken}"], cwd=ROOT,
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert subprocess.run([str(broken / "bin" / "pip"), "--version"], capture_output=True).returncode == 0


def test_every_declared_dependency_is_pinned_in_requirements():
    """setup.sh installs requirements.txt, then the package with --no-deps: a dependency declared only in
    pyproject.toml would be missing on a fresh clone (tiktoken was, once)."""
    import re

    import tomllib

    root = Path(__file__).resolve().parents[2]
    declared = tomllib.loads((root / "pyproject.toml").read_text())["project"]["dependencies"]
    pinned = {line.split("==")[0].strip().lower().replace("_", "-")
              for line in (root / "requirements.txt").read_text().splitlines() if "==" in line}
    names = {re.split(r"[<>=!~\[ ]", d, maxsplit=1)[0].lower().replace("_", "-") for d in declared}
    assert names <= pinned, f"declared in pyproject.toml but not pinned in requirements.txt: {sorted(names - pinned)}"
