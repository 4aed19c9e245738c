"""A PNG of the training curves (loss, per-step accuracy, estimated acceptance length) from metrics.jsonl."""

from __future__ import annotations

import json
from pathlib import Path


def plot_metrics(metrics_path: str | Path, out_png: str | Path) -> Path | None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    path = Path(metrics_path)
    if not path.is_file():
        return None
    rows = [json.loads(x) for x in path.read_text().splitlines() if x.strip()]
    train = [r for r in rows if r["split"] == "train"]
    val = [r for r in rows if r["split"] == "validation"]
    if not train:
        return None
    steps = sorted({int(k.split("_")[-1]) for k in train[0] if k.startswith("acc_")})
    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    axes[0].plot([r["step"] for r in train], [r["loss"] for r in train], label="train")
    if val:
        axes[0].plot([r["step"] for r in val], [r["loss"] for r in val], "o-", label="validation")
    axes[0].set(title="loss (mean over TTT steps)", xlabel="step")
    axes[0].legend()
    for j in steps:
        axes[1].plot([r["step"] for r in train], [r[f"acc_{j}"] for r in train], label=f"step {j}")
    axes[1].set(title="train accuracy per TTT step", xlabel="step", ylim=(0, 1))
    axes[1].legend(fontsize=7)
    src = val or train
    k = max(steps) + 1
    axes[2].plot([r["step"] for r in src], [r[f"accept_len_k{k}"] for r in src], "o-",
                 label=f"{'validation' if val else 'train'}, chain k={k}")
    if len(steps) >= 3:
        axes[2].plot([r["step"] for r in src], [r["accept_len_k3"] for r in src], "s--", label="chain k=3")
    axes[2].set(title="estimated acceptance length", xlabel="step")
    axes[2].legend()
    fig.tight_layout()
    fig.savefig(out_png, dpi=100)
    plt.close(fig)
    return Path(out_png)
