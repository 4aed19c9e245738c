"""Issue 9's check: a draft trained on hidden states from vLLM (`extract --backend vllm`) reaches the same vLLM
acceptance as one trained on the HF backend's, same data, seed and settings.

The HF side is `side_by_side.py`'s eagle3-train draft (run that first: `--only ours`); this script extracts the same
prepared rows through one vLLM hidden-state server, trains with the same settings, exports in the speculators format
and serves both drafts with the same prompts (`common.serve`).

  .venv/bin/python benchmarks/hf_vs_vllm_drafts.py --num-prompts 40
Results: benchmarks/out/hf_vs_vllm_drafts.json
"""

from __future__ import annotations

import argparse
import json
import time

import common as data
from common import HERE, MEASURES, serve

from eagle3_train.export.exporter import export
from eagle3_train.hidden_states.extract import extract
from eagle3_train.serving.vllm_server import hidden_states_server
from eagle3_train.settings.train import TrainConfig
from eagle3_train.train.trainer import train
from eagle3_train.utils.config import to_dataclass
from eagle3_train.utils.io import read_json, write_json

SIDE_BY_SIDE = HERE / "out" / "side_by_side.json"  # side_by_side.py's results (its HF-states draft)
WORK = HERE / "out" / "side_by_side" / "vllm-states"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--num-prompts", type=int, default=40)
    p.add_argument("--concurrency", type=int, default=8)
    args = p.parse_args()
    earlier = read_json(SIDE_BY_SIDE)
    hf = earlier.get("ours")
    if not hf:
        raise SystemExit("run `side_by_side.py --only ours` first: it trains and serves the HF-states draft")
    verifier = read_json(data.OUT / "hidden" / "manifest.json")["verifier"]["path"]
    hidden = WORK / "hidden"
    if not (hidden / "manifest.json").is_file() or read_json(hidden / "manifest.json").get("status") != "complete":
        with hidden_states_server(verifier, storage_dir=WORK / "server-states", log_path=WORK / "vllm-hs.log") as s:
            t0 = time.perf_counter()
            extract(data.OUT / "prepared", verifier, hidden, backend="vllm", endpoints=[s.base_url],
                    vllm_options={"concurrency": args.concurrency, "hidden_states_dir": s.hidden_states_dir},
                    dtype="bfloat16", splits=("train",))
            extract_s = round(time.perf_counter() - t0, 1)
    else:
        extract_s = None
    settings = hf["settings"]  # the HF draft's settings, unchanged
    result = train(to_dataclass(TrainConfig, dict(prepared=str(data.OUT / "prepared"), hidden_states=str(hidden),
                                                  vocab=str(data.OUT / "vocab"), out=str(WORK / "train"),
                                                  **settings), "hf-vs-vllm"))
    export(WORK / "train", WORK / "export-speculators", fmt="speculators")
    served = serve(str(WORK / "export-speculators"), args.num_prompts, WORK)
    out = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "settings": settings,
           "extract_vllm_s": extract_s, "steps": result["step"],
           "hf_states": {"train_estimate": _last_estimate(hf["metrics"]), "vllm": hf["vllm"]},
           "vllm_states": {"train_estimate": _last_estimate(str(WORK / "train" / "metrics.jsonl")), "vllm": served}}
    write_json(data.OUT.parent / "hf_vs_vllm_drafts.json", out)
    for m, _, _ in MEASURES:
        print(f"{m}: HF states {hf['vllm'][m]['mean_acceptance_length']:.3f}, vLLM states "
              f"{served[m]['mean_acceptance_length']:.3f}")


def _last_estimate(metrics: str) -> float:
    rows = [json.loads(x) for x in open(metrics) if x.strip()]
    return [r for r in rows if r["split"] == "train"][-1]["accept_len_k3"]


if __name__ == "__main__":
    main()
