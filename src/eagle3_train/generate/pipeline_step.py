"""The generate stage of `eagle3-train run`: serve the verifier with vLLM, regenerate the assistant turns, stop.

`max_turns` keeps the first N user turns of each conversation (regeneration time grows with every turn:
`first_turns.py`).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

from eagle3_train.assets.data_spec import DataSource
from eagle3_train.generate.first_turns import cut_turns, jsonl_record
from eagle3_train.settings import GenerateSettings
from eagle3_train.utils.io import atomic_path

log = logging.getLogger(__name__)


def run_generation_for_pipeline(source: DataSource, verifier_dir: Path, out_dir: Path, settings: dict[str, Any],
                                serving: dict[str, Any] | None = None, trust_remote_code: bool = False
                                ) -> dict[str, Any]:
    """Serve the verifier (`serving`: ServingSettings values; generate.max_model_len, when set, wins) and
    regenerate the assistant turns of `source` into `out_dir`."""
    from eagle3_train.generate.conversation import tool_server_args
    from eagle3_train.generate.regenerate import regenerate
    from eagle3_train.generate.resume import SERVER_LOG, claim_generate_output
    from eagle3_train.serving.vllm_server import VLLMServer, vllm_available

    ok, message = vllm_available()
    if not ok:
        return {"skipped": True, "reason": message}
    s = dict(settings)
    limit, max_turns = s.pop("limit", None), s.pop("max_turns", None)
    if max_turns:
        source = str(cut_turns(source, out_dir.parent / "generate-source.jsonl", limit, int(max_turns),
                               bool(s.get("skip_bad_records", False))))
    out_dir = claim_generate_output(out_dir)
    # a pipeline stage: on CPU, eager start-up pays off
    opts = {"startup_matters": True, "trust_remote_code": trust_remote_code, **(serving or {})}
    max_model_len = s.pop("max_model_len", GenerateSettings.max_model_len)
    if max_model_len:
        opts["max_model_len"] = int(max_model_len)
    tools = tool_server_args(source, str(verifier_dir), verifier_dir, s.get("thinking_style") or "auto", limit,
                             bool(s.get("skip_bad_records", False)))
    with VLLMServer(verifier_dir, log_path=out_dir / SERVER_LOG, extra_args=tools, **opts) as server:
        manifest = regenerate(source, out_dir, [server.base_url], server.model_name, limit=limit, **s)
    return {"skipped": False, "counts": manifest.get("counts"), "out": str(out_dir / "conversations.jsonl")}


def mix_with_originals(source: DataSource, generated: Path, out_file: Path, limit: int | None,
                       skip_bad_records: bool = False) -> dict[str, int]:
    """Write the regenerated conversations, then the source's first `limit` conversations that were not regenerated
    with their original answers, as one messages JSONL; returns how many of each."""
    from eagle3_train.assets.conversations import load_conversations

    regenerated = 0
    done: set[str] = set()
    with atomic_path(out_file) as tmp, open(tmp, "w") as f:
        with open(generated) as g:
            for line in g:
                if line.strip():
                    done.add(json.loads(line)["id"])
                    f.write(line if line.endswith("\n") else line + "\n")
                    regenerated += 1
        conversations, _ = load_conversations(source, limit=limit, skip_bad_records=skip_bad_records)
        original = 0
        for conv in conversations:
            if conv.id not in done:
                f.write(jsonl_record(conv, conv.messages))
                original += 1
    return {"regenerated": regenerated, "original": original}
