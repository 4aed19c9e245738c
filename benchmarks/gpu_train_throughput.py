"""Training-step throughput and peak GPU memory of the real trainer at users' verifier shapes, no data on disk.

The draft is built by the trainer's own `build_model` for a verifier of the named shape (Llama-3.1-8B: hidden 4096,
32 heads / 8 kv, intermediate 14336, vocab 128256; Kimi-K2 with the AQ-MedAI draft's layer: hidden 7168, 64 heads /
64 kv of 128, intermediate 18432, vocab 163840), draft vocab 32000. The verifier embedding and lm_head are random
tensors made on the device, and the "hidden states" are random batches already on the device, so the timing is the
optimizer step alone: `Trainer.train_step` (verifier targets, TTT forward, backward, all-reduce no-op, clip, the
optimizer: `--optimizer`, the trainer's default Muon since 2026-12-05; figures from before were AdamW's), the code
`eagle3-train train` runs, under its precision setting (bf16 autocast, fp32 master weights by default).

Tokens/s excludes warm-up steps and is timed between `torch.cuda.synchronize()` calls; peak memory is
`torch.cuda.max_memory_allocated()` over each setting's steps (model, optimizer state and the step's activations).

  python3 benchmarks/gpu_train_throughput.py --shapes llama3.1-8b,kimi-k2 --ttt 7,3 --out bench.json   # on a GPU
  PYTHONPATH=src python benchmarks/gpu_train_throughput.py --device cpu --tiny                           # smoke test
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import math
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from eagle3_train.assets.verifier import Verifier  # noqa: E402
from eagle3_train.model.aux_layers import default_layer_ids  # noqa: E402
from eagle3_train.model.verifier_head import LogitTransform  # noqa: E402
from eagle3_train.settings.train import TrainConfig  # noqa: E402
from eagle3_train.train.build import build_model  # noqa: E402
from eagle3_train.train.data import Batch  # noqa: E402
from eagle3_train.train.inputs import RunInputs  # noqa: E402
from eagle3_train.train.optimizer import (
    DraftOptimizer,  # noqa: E402
    lr_lambda,  # noqa: E402
)
from eagle3_train.train.precision import resolve_precision, verifier_tensor_dtype  # noqa: E402
from eagle3_train.train.trainer import Trainer  # noqa: E402
from eagle3_train.utils.distributed import DistInfo  # noqa: E402
from eagle3_train.utils.settings import build_settings  # noqa: E402

# Verifier configs (the fields the draft is derived from). Kimi-K2's own attention is MLA; its published EAGLE-3 draft
# (AQ-MedAI/Kimi-K2-Instruct-eagle3) is a Llama layer with 64 heads of 128 and intermediate 18432, given here.
SHAPES: dict[str, dict[str, Any]] = {
    "llama3.1-8b": {"hidden_size": 4096, "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
                    "intermediate_size": 14336, "vocab_size": 128256, "num_hidden_layers": 32,
                    "rms_norm_eps": 1e-5, "rope_theta": 500000.0, "max_position_embeddings": 131072,
                    "architectures": ["LlamaForCausalLM"], "model_type": "llama"},
    "kimi-k2": {"hidden_size": 7168, "num_attention_heads": 64, "num_key_value_heads": 64, "head_dim": 128,
                "intermediate_size": 18432, "vocab_size": 163840, "num_hidden_layers": 61, "rms_norm_eps": 1e-6,
                "rope_theta": 1000000.0, "max_position_embeddings": 131072,
                "architectures": ["DeepseekV3ForCausalLM"], "model_type": "kimi_k2"},
    "tiny": {"hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
             "intermediate_size": 128, "vocab_size": 1024, "num_hidden_layers": 8, "rms_norm_eps": 1e-6,
             "rope_theta": 10000.0, "max_position_embeddings": 4096, "architectures": ["LlamaForCausalLM"],
             "model_type": "llama"},
}


class SyntheticSamples:
    """Stands in for `TrainingSamples`: fixed random batches, already on the device, handed out in turn."""

    skipped = 0

    def __init__(self, batches: list[Batch]):
        self.batches = batches
        self.lengths = [int(b.lengths.sum()) for b in batches]

    def __len__(self) -> int:
        return len(self.batches)

    def batch(self, positions: list[int]) -> Batch:
        return self.batches[positions[0] % len(self.batches)]

    def close(self) -> None:
        pass


def random_inputs(shape: dict[str, Any], draft_vocab: int, device: torch.device, seed: int = 0) -> RunInputs:
    """RunInputs of a random verifier of this shape: embedding and lm_head made on the device (bf16, std 0.02),
    a random sorted draft vocabulary."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    V, H = shape["vocab_size"], shape["hidden_size"]
    ids = torch.sort(torch.randperm(V, generator=g)[:draft_vocab]).values
    d2t = ids - torch.arange(draft_vocab)
    t2d = torch.zeros(V, dtype=torch.bool)
    t2d[ids] = True
    torch.manual_seed(seed)
    embed = (0.02 * torch.randn(V, H, device=device)).to(torch.bfloat16)
    lm_head = (0.02 * torch.randn(V, H, device=device)).to(torch.bfloat16)
    layers = tuple(default_layer_ids(shape["num_hidden_layers"], "synthetic verifier"))
    return RunInputs(prepared_dir=Path("."), prepared_manifest={}, prepared_manifest_sha256="", hidden_dir=Path("."),
                     hidden_manifest={}, hidden_manifest_sha256="", vocab_path=Path("."), vocab_sha256="", d2t=d2t,
                     t2d=t2d, verifier=Verifier("synthetic", Path("."), dict(shape)), verifier_identity={},
                     embed=embed, lm_head=lm_head, layer_ids=layers,
                     logit_transform=LogitTransform())


def random_batches(shape: dict[str, Any], n: int, batch: int, seq_len: int, device: torch.device,
                   prompt_share: float = 0.3) -> list[Batch]:
    """`n` batches of `batch` x `seq_len` tokens: random ids, the first `prompt_share` of each sequence unsupervised
    (a prompt), random bf16 aux / final states (the dtype extract stores)."""
    V, H = shape["vocab_size"], shape["hidden_size"]
    out = []
    for _ in range(n):
        ids = torch.randint(0, V, (batch, seq_len), device=device)
        mask = torch.zeros(batch, seq_len, dtype=torch.bool, device=device)
        mask[:, int(prompt_share * seq_len):] = True
        aux = torch.randn(batch, seq_len, 3 * H, device=device, dtype=torch.bfloat16)
        final = torch.randn(batch, seq_len, H, device=device, dtype=torch.bfloat16)
        out.append(Batch(ids, mask, aux, final, torch.full((batch,), seq_len)))
    return out


class SyntheticTrainer(Trainer):
    """A `Trainer` whose data and verifier head are synthetic; what `train_step` runs is the trainer's own code.
    Mirrors the model/optimizer part of `Trainer.__init__` (no run directory, no data files)."""

    def __init__(self, cfg: TrainConfig, inputs: RunInputs, samples: SyntheticSamples, device: torch.device):
        self.cfg, self.info, self.device, self.inputs = cfg, DistInfo(), device, inputs
        self.precision = resolve_precision(cfg.precision, device)
        self.model = build_model(cfg, inputs, device=str(device))
        frozen = verifier_tensor_dtype(self.precision)
        self.model.embed_tokens.to(frozen)
        self.inputs.lm_head = self.inputs.lm_head.to(frozen)
        self.model.to(device)
        self.train_data, self.val_data = samples, None
        self.micro_per_step = 1
        self._setup_parallel()  # the objective, the noise and the (one-process) engine, as the trainer sets them
        self.optimizer = DraftOptimizer(self.model, cfg, lr_lambda(1000, cfg.warmup_ratio, cfg.min_lr_ratio))
        self.skipped_now, self.skipped_before = 0, 0


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_setting(trainer: SyntheticTrainer, warmup: int, steps: int) -> dict[str, Any]:
    """Run warm-up then timed optimizer steps with the trainer's current cfg; tokens/s, step time, peak memory."""
    dev = trainer.device
    n = len(trainer.train_data)
    if dev.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(dev)
    for i in range(warmup):
        trainer.train_step([[i % n]])
    _sync(dev)
    t0 = time.perf_counter()
    tokens, losses = 0, []
    for i in range(steps):
        sums, t = trainer.train_step([[(warmup + i) % n]])
        tokens += t
        losses.append(sums.summary()["loss"])
    _sync(dev)
    dt = time.perf_counter() - t0
    rec: dict[str, Any] = {"tokens": tokens, "seconds": round(dt, 3), "tokens_per_s": round(tokens / dt, 1),
                           "step_ms": round(1000 * dt / steps, 1), "loss_first": losses[0], "loss_last": losses[-1],
                           "loss_finite": all(math.isfinite(x) for x in losses), "grad_norm": trainer.grad_norm}
    if dev.type == "cuda":
        rec["peak_allocated_gib"] = round(torch.cuda.max_memory_allocated(dev) / 2**30, 2)
        rec["peak_reserved_gib"] = round(torch.cuda.max_memory_reserved(dev) / 2**30, 2)
    return rec


def bench_shape(name: str, args: argparse.Namespace, device: torch.device, report) -> None:
    """All settings of one verifier shape on one model and optimizer (settings change only the step's code path)."""
    shape = SHAPES[name]
    draft_vocab = min(args.draft_vocab, shape["vocab_size"] // 4) if name == "tiny" else args.draft_vocab
    seq_len = min(args.seq_len, 128) if name == "tiny" else args.seq_len
    t0 = time.perf_counter()
    inputs = random_inputs(shape, draft_vocab, device)
    samples = SyntheticSamples(random_batches(shape, 3, args.batch, seq_len, device))
    ttts = [int(x) for x in args.ttt.split(",")]
    base = build_settings(TrainConfig, dict(ttt_steps=max(ttts), token_budget=args.batch * seq_len, lr=1e-4,
                                            precision=args.precision, device=str(device), tensorboard=False,
                                            optimizer=args.optimizer),
                          "benchmark")
    trainer = SyntheticTrainer(base, inputs, samples, device)
    n_params = sum(p.numel() for p in trainer.engine.parameters())
    static = torch.cuda.memory_allocated(device) / 2**30 if device.type == "cuda" else None
    setup_s = round(time.perf_counter() - t0, 1)
    for ttt in ttts:
        for ck in args.checkpointing:
            ck_loss, ck_mlp = {"on": (True, True), "off": (False, False), "loss": (True, False),
                               "mlp": (False, True)}[ck]
            trainer.cfg = dataclasses.replace(base, ttt_steps=ttt, checkpoint_loss=ck_loss, checkpoint_mlp=ck_mlp)
            trainer._setup_parallel()  # the engine's forward reads the objective of these settings
            rec = {"shape": name, "ttt_steps": ttt, "checkpoint_loss": ck_loss, "checkpoint_mlp": ck_mlp,
                   "batch": args.batch, "seq_len": seq_len, "draft_vocab": draft_vocab, "precision": trainer.precision,
                   "trainable_params_m": round(n_params / 1e6, 1), "setup_s": setup_s,
                   "static_allocated_gib": None if static is None else round(static, 2)}
            try:
                rec.update(time_setting(trainer, args.warmup, args.steps))
            except torch.OutOfMemoryError as e:
                rec["error"] = f"out of memory: {str(e).splitlines()[0]}"
                trainer.optimizer.zero_grad(set_to_none=True)
            except Exception as e:  # noqa: BLE001 - one setting failing must not stop the others
                rec["error"] = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
                trainer.optimizer.zero_grad(set_to_none=True)
            report(rec)
    del trainer, samples, inputs
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shapes", default="llama3.1-8b,kimi-k2", help=f"comma-separated, of {', '.join(SHAPES)}")
    p.add_argument("--tiny", action="store_true", help="the tiny shape only (CPU smoke test)")
    p.add_argument("--device", default="cuda")
    p.add_argument("--precision", default="bf16", choices=["bf16", "fp32"])
    p.add_argument("--optimizer", default=TrainConfig.optimizer, choices=["adamw", "muon"])
    p.add_argument("--ttt", default="7,3", help="TTT steps to time, comma-separated")
    p.add_argument("--checkpointing", default="on,off",
                   help="comma-separated of on (checkpoint_loss and _mlp), off (neither), loss, mlp (only that one)")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--seq-len", type=int, default=2048, help="tokens per sequence (batch x seq-len per step)")
    p.add_argument("--draft-vocab", type=int, default=32000)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--steps", type=int, default=8, help="timed optimizer steps per setting")
    p.add_argument("--out", help="write the results (JSON) here")
    args = p.parse_args()
    args.checkpointing = args.checkpointing.split(",")
    shapes = ["tiny"] if args.tiny else args.shapes.split(",")
    device = torch.device(args.device)
    results: dict[str, Any] = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
                               "torch": torch.__version__, "runs": []}

    def report(rec: dict[str, Any]) -> None:
        results["runs"].append(rec)
        if "error" in rec:
            print(f"{rec['shape']} ttt={rec['ttt_steps']} ckpt_loss={rec['checkpoint_loss']} "
                  f"ckpt_mlp={rec['checkpoint_mlp']}: FAILED {rec['error']}", flush=True)
        else:
            print(f"{rec['shape']} ttt={rec['ttt_steps']} ckpt_loss={rec['checkpoint_loss']} "
                  f"ckpt_mlp={rec['checkpoint_mlp']}: {rec['tokens_per_s']} tok/s, {rec['step_ms']} ms/step, "
                  f"peak {rec.get('peak_allocated_gib')} GiB, loss {rec['loss_first']:.3f} -> {rec['loss_last']:.3f}",
                  flush=True)
        if args.out:
            Path(args.out).write_text(json.dumps(results, indent=2))

    failed = False
    for name in shapes:
        if name not in SHAPES:
            sys.exit(f"unknown shape {name!r}: choose from {', '.join(SHAPES)}")
        try:
            bench_shape(name, args, device, report)
        except Exception as e:  # noqa: BLE001 - e.g. out of memory building one shape: the next shape still runs
            failed = True
            report({"shape": name, "ttt_steps": None, "checkpoint_loss": None, "checkpoint_mlp": None,
                    "error": f"setup: {type(e).__name__}: {e}"})
            gc.collect()
            if device.type == "cuda":
                torch.cuda.empty_cache()
    failed = failed or any("error" in r or not r.get("loss_finite", True) for r in results["runs"])
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
