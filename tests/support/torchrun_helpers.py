"""Launching `torch.distributed.run` from tests: a free port, and a run in its own process group, so a test that
times out kills the workers with the launcher instead of leaving them running (and holding the port) after it."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys

import pytest


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_group(cmd: list[str], timeout: float, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """Run `cmd` with captured text output in a new session; past `timeout` the whole group is killed and the test
    fails with the output's tail."""
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1"} if env is None else env,
                            start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        pytest.fail(f"{' '.join(cmd[:8])} ... ran over {timeout:.0f} s; its group was killed:\n{err[-3000:]}")
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def torchrun(args: list[str], nproc: int = 2, timeout: float = 600, env: dict[str, str] | None = None,
             launcher: tuple[str, ...] = ()) -> subprocess.CompletedProcess:
    """`python -m torch.distributed.run --nproc-per-node N [--master-port P | launcher flags] ARGS` (`args`: what
    follows the launcher's flags, e.g. ["-m", "eagle3_train.cli", "train", ...])."""
    flags = list(launcher) or ["--master-port", str(free_port())]
    return run_group([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc), *flags, *args],
                     timeout, env)
