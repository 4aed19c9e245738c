"""Progress on a pipe: with stderr going to a file, `progress()` logs lines with count, rate and ETA instead of a
terminal bar; EAGLE3_TRAIN_NO_PROGRESS=1 silences them."""

from __future__ import annotations

import logging
import os
import re
import subprocess
import sys
import textwrap

import pytest

from eagle3_train.utils.io import Eagle3InputError
from eagle3_train.utils.progress import INTERVAL_ENV, LogProgress, progress

# What a stage does with its bar (the train stage's calls), logging set up as the CLI does.
STAGE = textwrap.dedent("""
    import logging
    from eagle3_train.utils.progress import progress
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    bar = progress(total=20, desc="train", unit="step", initial=4)
    for step in range(5, 21):
        sum(i * i for i in range(20000))  # some work, so that time passes
        bar.update(1)
        bar.set_postfix(loss=f"{1 / step:.3f}")
    bar.close()
""")
LINE = re.compile(r"eagle3_train\.progress: train (\d+)/20 step \((\d+)%\)(?: \| (.+?) step/s)? \| elapsed \d\d:\d\d"
                  r"(?: \| ETA \d\d:\d\d)?(?: \| loss=(\S+))?$")


def _run_stage(tmp_path, **env) -> list[str]:
    log_file = tmp_path / "stage.log"
    with open(log_file, "w") as err:  # stderr is a file, not a terminal
        subprocess.run([sys.executable, "-c", STAGE], stderr=err, check=True,
                       env={**os.environ, "EAGLE3_TRAIN_NO_PROGRESS": "", **env})
    return log_file.read_text().splitlines()


def test_lines_with_count_rate_and_eta_when_stderr_is_a_file(tmp_path):
    lines = _run_stage(tmp_path, **{INTERVAL_ENV: "0"})  # interval 0: a line at every update
    assert "\r" not in "".join(lines)
    matches = [LINE.search(ln) for ln in lines]
    assert all(matches), lines
    counts = [int(m.group(1)) for m in matches]
    assert counts == list(range(4, 21))  # the start line, then one per update; close repeats nothing
    assert [int(m.group(2)) for m in matches] == [round(100 * n / 20) for n in counts]
    later = matches[1:]
    assert all(m.group(3) and "ETA" in m.group(0) for m in later)  # rate and ETA once something was done
    assert [m.group(4) for m in later] == [None] + [f"{1 / s:.3f}" for s in range(5, 20)]  # postfix set after


def test_no_progress_env_silences_the_lines(tmp_path):
    assert _run_stage(tmp_path, **{INTERVAL_ENV: "0", "EAGLE3_TRAIN_NO_PROGRESS": "1"}) == []


def test_one_line_per_interval_and_a_last_one(caplog, monkeypatch):
    monkeypatch.setenv(INTERVAL_ENV, "1e9")  # nothing between the start and the end
    monkeypatch.delenv("EAGLE3_TRAIN_NO_PROGRESS", raising=False)
    caplog.set_level(logging.INFO, logger="eagle3_train.progress")
    with progress(total=None, desc="prepare", unit="conv") as bar:
        assert isinstance(bar, LogProgress)  # pytest captures stderr: not a terminal
        for _ in range(50):
            bar.update(1)
            bar.set_postfix_str("shard 1/1")
    msgs = [r.getMessage() for r in caplog.records]
    assert len(msgs) == 2 and msgs[0].startswith("prepare 0 conv |")
    assert msgs[1].startswith("prepare 50 conv |") and msgs[1].endswith("| shard 1/1") and "conv/s" in msgs[1]


def test_bad_interval_is_a_clear_error(monkeypatch):
    monkeypatch.setenv(INTERVAL_ENV, "soon")
    with pytest.raises(Eagle3InputError, match=INTERVAL_ENV):
        progress(total=3)
