"""The reliability campaign (scripts/reliability_campaign.py) in a short form that fits CI: kill -9 of extract and
train with resume, and generate under load through a faulty proxy. The bad-input rows (tens of CLI starts), the
whole `run` pipeline and generation against vLLM are left to the full campaign; the faults it found have their own
tests (test_fault_handling.py, test_conversations.py, test_prepare.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_short_campaign_rows_are_recorded_and_lose_nothing(tmp_path):
    out = tmp_path / "campaign"
    cmd = [sys.executable, str(REPO / "scripts" / "reliability_campaign.py"), "--short", "--kills", "1",
           "--stages", "kill-extract,kill-train,load", "--out", str(out)]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=1800,
                       env={**os.environ, "EAGLE3_TRAIN_NO_PROGRESS": "1"})
    assert (out / "results.json").is_file(), r.stdout[-3000:] + r.stderr[-3000:]
    rows = json.loads((out / "results.json").read_text())["rows"]
    stages = {row["stage"] for row in rows}
    assert stages == {"extract", "train", "generate (load)"}
    kills = [row for row in rows if row["fault"].startswith("kill -9")]
    assert {row["stage"] for row in kills} == {"extract", "train"}
    # Nothing is ever lost, whatever else fails; a kill's resume ends identical to the uninterrupted run.
    assert all(row["lost"] == 0 for row in rows), [row for row in rows if row["lost"]]
    assert all(row["ok"] for row in kills), kills
    load = next(row for row in rows if row["stage"] == "generate (load)")
    assert load["handled"].startswith("exit 0") and load["lost"] == 0  # exactly once; throughput is machine-bound
    assert load["details"]["drops_before"] + load["details"]["drops_after"] > 0
    assert load["details"]["retries"] >= load["details"]["drops_before"] + load["details"]["drops_after"]
    table = (out / "results.md").read_text()
    assert table.count("\n| ") == len(rows) + 1  # header + one line per row
