"""`eagle3-train train`: training-time-test training (or finetuning) of an EAGLE-3 draft on extracted hidden states.

Python API: `train(TrainConfig) -> dict` (final metrics and paths). Works single-process or under
`torchrun --nproc-per-node N -m eagle3_train.cli train ...` (gloo on CPU, NCCL on CUDA) with torch's DDP or FSDP2
(`train.parallel`, train/parallel.py), in every hidden-state mode (offline, online, hybrid: each rank fetches its own
micro-batches).
"""

from __future__ import annotations

import gc
import logging
import math
import sys
import time
from pathlib import Path
from typing import Any

import torch

from eagle3_train.assets.verifier import Verifier
from eagle3_train.checkpoints import native as ckpt
from eagle3_train.hidden_states.modes import states_mode
from eagle3_train.settings import NUM_SPECULATIVE_TOKENS
from eagle3_train.settings.train import TrainConfig
from eagle3_train.train import checkpointing
from eagle3_train.train.batching import plan_batches
from eagle3_train.train.build import build_model, init_record
from eagle3_train.train.data import Batch, TrainingSamples, open_samples, open_validation
from eagle3_train.train.finetune import finetune_model
from eagle3_train.train.inputs import resolve_inputs
from eagle3_train.train.losses import check_loss
from eagle3_train.train.metadata import OUTPUT, WRITES, build_metadata, timing_record, written_by_train
from eagle3_train.train.method_objectives import attention_kernel, method_denominators
from eagle3_train.train.metrics_log import MetricsLog
from eagle3_train.train.objective import FeatureNoise, Objective
from eagle3_train.train.optimizer import DraftOptimizer, lr_lambda
from eagle3_train.train.parallel import TTTModule, choose_engine, make_engine
from eagle3_train.train.precision import autocast, resolve_precision, verifier_tensor_dtype
from eagle3_train.train.prefetch import Prefetcher
from eagle3_train.train.resume import grad_accum_to_resume
from eagle3_train.train.targets import verifier_targets
from eagle3_train.train.ttt import StepSums
from eagle3_train.utils.distributed import (
    all_reduce_sum_,
    barrier,
    destroy,
    init_device,
)
from eagle3_train.utils.finite import first_non_finite
from eagle3_train.utils.host_memory import active_allocator, malloc_trim
from eagle3_train.utils.io import Eagle3InputError, write_json
from eagle3_train.utils.outputs import claim_output_dir, output_lock, set_aside
from eagle3_train.utils.progress import progress
from eagle3_train.utils.provenance import now_iso

log = logging.getLogger(__name__)


class Trainer:
    """One run: set up in named steps (device, model, data, optimizer), then `run()` the loop."""

    def __init__(self, cfg: TrainConfig, verifier: Verifier | None = None):
        self.cfg, self.verifier = cfg, verifier
        self.out = Path(cfg.out)
        check_loss(cfg.loss)
        self._setup_device()
        self._setup_model()
        self._setup_data()
        self._setup_parallel()
        self._setup_optimizer()
        self._setup_state()

    def _setup_device(self) -> None:
        """This process's rank (torchrun) and device, and the precision it resolves to there."""
        self.info, self.device = init_device(self.cfg.device)
        self.precision = resolve_precision(self.cfg.precision, self.device)
        if self.cfg.resume:
            self._keep_global_batch()

    def _keep_global_batch(self) -> None:
        """Resumed on another number of processes: grad_accum follows, so one step keeps its micro-batches."""
        latest = ckpt.latest_checkpoint(self.out) if self.out.is_dir() else None
        new = None if latest is None else grad_accum_to_resume(latest, self.info.world_size)
        if new is not None and new != self.cfg.grad_accum:
            log.warning("resuming %s on %d processes: grad_accum %d -> %d keeps its micro-batches per step (the same "
                        "data order)", latest, self.info.world_size, self.cfg.grad_accum, new)
            self.cfg.grad_accum = new

    def _setup_model(self) -> None:
        """The run's inputs, the draft (built, or a finetune source read, checked, then loaded into a draft of its own
        architecture), the frozen tensors in their dtype, everything on the device and the same on every rank."""
        cfg = self.cfg
        self.inputs = resolve_inputs(cfg, verifier=self.verifier)
        self.model, self.init_record = (finetune_model(cfg, self.inputs) if cfg.finetune_from
                                        else (build_model(cfg, self.inputs), init_record(cfg)))
        frozen = verifier_tensor_dtype(self.precision)
        if not self.model.config.own_embedding:  # the verifier's, frozen; an own embedding trains in full precision
            self.model.embed_tokens.to(frozen)
        self.inputs.lm_head = self.inputs.lm_head.to(frozen)
        self.model.to(self.device)
        # the objective's attention kernel (later TTT steps: model/ttt_attention.py), checked on this device
        self.ttt_kernel = attention_kernel(self.model, self.device,
                                           torch.bfloat16 if self.precision == "bf16" else torch.float32)

    def _setup_data(self) -> None:
        """This rank's share of the training and validation samples, and the steps they make."""
        cfg = self.cfg
        ranks = dict(rank=self.info.rank, world_size=self.info.world_size)
        self.train_data = open_samples(cfg, self.inputs, "train", **ranks)
        if len(self.train_data) == 0:
            raise Eagle3InputError(f"no training samples with hidden states in {cfg.hidden_states}/train")
        self.val_data = open_validation(cfg, self.inputs, **ranks)
        self.micro_per_step = cfg.grad_accum * self.info.world_size
        n_batches = len(plan_batches(self.train_data.lengths, cfg.token_budget, cfg.seed, 0))
        self.steps_per_epoch = max(1, n_batches // self.micro_per_step)
        self.total_steps = cfg.max_steps or max(1, math.ceil(cfg.epochs * self.steps_per_epoch))

    def _setup_parallel(self) -> None:
        """The objective a batch is trained on, and the data-parallel engine that runs it (train/parallel.py)."""
        cfg = self.cfg
        self.objective = Objective.from_config(cfg)  # how a batch becomes a loss (train/objective.py)
        self.noise = FeatureNoise(cfg.noise)  # training batches only
        trainable = sum(p.numel() for p in self.model.parameters() if p.requires_grad)
        engine = choose_engine(cfg.parallel, self.info, self.device, trainable)
        self.engine = make_engine(engine, TTTModule(self.model, self.objective), self.info, self.device,
                                  self.precision, cfg.offload_optimizer)

    def _setup_optimizer(self) -> None:
        """The optimizer (over the engine's parameters: each rank's shards under FSDP) and its schedule."""
        cfg = self.cfg
        self.optimizer = DraftOptimizer(self.model, cfg,
                                        lr_lambda(self.total_steps, cfg.warmup_ratio, cfg.min_lr_ratio))

    def _setup_state(self) -> None:
        """Progress and bookkeeping of a run that has not trained yet (a resume overwrites them)."""
        self.step = 0
        self.epoch = 0
        self.batch_in_epoch = 0  # next micro-batch index in this epoch's plan
        self.tokens_seen = 0
        self.best: dict[str, Any] = {}
        self.last_val: dict[str, float] = {}
        self.validated_step = -1  # the step of the last validation (a resumed finished run must not log it again)
        self.stale_validations = 0  # validations in a row without a better estimate (train.early_stop)
        self.metrics = MetricsLog(self.out, self.info.is_main)
        self.last_train: dict[str, float] = {}
        self.started = now_iso()
        self.last_save = time.monotonic()
        self.skipped_before = 0  # samples the sources skipped in earlier invocations (resume)
        self.skipped_now = 0  # ...in this one, summed over the ranks, in the steps trained and validations run
        self.timing = {"fetch_wait_s": 0.0, "train_s": 0.0}  # this invocation: waiting on the source, computing
        self.release_host_memory = (malloc_trim() if self.cfg.release_host_memory and self.device.type == "cpu"
                                    else None)
        self.host_malloc = active_allocator()  # fixed for the life of the process

    # --- bookkeeping ----------------------------------------------------------------------------------------------
    def metadata(self, status: str) -> dict[str, Any]:
        return build_metadata(self.cfg, self.inputs, self.model.config, self.init_record, self.info.world_size,
                              started=self.started, status=status,
                              progress={"step": self.step, "total_steps": self.total_steps, "epoch": self.epoch,
                                        "tokens": self.tokens_seen},
                              metrics={"train": self.last_train, "validation": self.last_val, "best": self.best},
                              source={**self.train_data.source.identity(),  # mode, servers
                                      "skipped_samples": self.skipped_samples()},
                              compute={"device": str(self.device), "precision": self.precision,
                                       "parallel": self.engine.name, "host_malloc": self.host_malloc,
                                       "ttt_attention": self.ttt_kernel})

    def skipped_samples(self) -> int:
        """Samples the sources skipped in the steps trained and the validations run, over all ranks (a step fetched
        ahead but not trained is not counted: a resume fetches it again)."""
        return self.skipped_before + self.skipped_now


    def log_metrics(self, split: str, values: dict[str, float]) -> None:
        self.metrics.write(split, values, step=self.step, epoch=self.epoch, tokens_seen=self.tokens_seen)

    # --- compute ------------------------------------------------------------------------------------------------
    def _forward(self, batch, denominators: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        with autocast(self.device, self.precision):
            targets = verifier_targets(batch.final, batch.loss_mask, self.inputs.lm_head_on(self.device),
                                       self.model.draft_token_ids(), self.model.t2d, self.inputs.logit_transform,
                                       full_argmax=batch.verifier_argmax, full_lse=batch.verifier_lse)
            return self.engine.module(batch, targets, denominators)

    def _idle_batch(self) -> Batch:
        """A batch that supervises nothing, on the device: a rank short of micro-batches (the source skipped all of
        one) runs it, so every rank takes part in the same number of forward passes and gradient reductions."""
        aux = self.model.config.aux_hidden_size
        return Batch(torch.zeros(1, 4, dtype=torch.long), torch.zeros(1, 4, dtype=torch.bool),
                     torch.zeros(1, 4, 3 * aux), torch.zeros(1, 4, self.inputs.lm_head.shape[1]),
                     torch.tensor([4])).to(self.device, torch.float32)

    def _slots(self, items: list) -> int:
        """Forward passes every rank runs over its share `items[rank::world]` of `items`: rank 0's share, the
        largest. FSDP gathers weights in every forward, so a rank whose share is shorter, or whose batch the source
        skipped whole, runs idle batches in those slots; the count needs no communication."""
        return len(items[::self.info.world_size])

    def rank_batches(self, micro: list[list[int]]) -> list:
        """This rank's share of a step's micro-batches (each rank fetches only its own), samples skipped left out."""
        mine = micro[self.info.rank::self.info.world_size]
        batches = [b for b in (self.train_data.batch(m) for m in mine) if b is not None]
        if self.cfg.supervise == "all":  # training only: validation keeps scoring what is served, assistant tokens
            batches = [b.supervising_every_token() for b in batches]
        return batches

    def fetch_step(self, micro: list[list[int]]) -> tuple[list[list[int]], list, int]:
        """(micro, this rank's share fetched, samples the source skipped doing so). One fetch at a time."""
        before = self.train_data.skipped
        batches = self.rank_batches(micro)
        return micro, batches, self.train_data.skipped - before

    def train_step(self, micro: list[list[int]], batches: list | None = None, skipped: int = 0
                   ) -> tuple[StepSums, int]:
        """One optimizer step over this rank's share of `micro` (all ranks see the same list); `batches`: that
        share already fetched, `skipped`: samples left out of it by the source (counted over the ranks)."""
        cfg = self.cfg
        if batches is None:
            _, batches, skipped = self.fetch_step(micro)
        denom = torch.zeros(cfg.ttt_steps, dtype=torch.float64)
        for b in batches:
            denom += method_denominators(cfg.method, b, cfg.ttt_steps).cpu()  # batches may already sit on the GPU
        all_reduce_sum_(denom, self.info)
        self.engine.module.train()
        self.optimizer.zero_grad(set_to_none=True)
        sums = StepSums(cfg.ttt_steps)
        tokens = 0
        padded = batches + [None] * (self._slots(micro) - len(batches))  # real batches first: the last reduces
        for i, b in enumerate(padded):
            idle = b is None
            b = self._idle_batch() if idle else self.noise(b.to(self.device, torch.float32))  # training only
            with self.engine.sync(last=i == len(padded) - 1):
                loss, s = self._forward(b, denom.to(self.device))
                (loss * (0.0 if idle else self.engine.loss_scale)).backward()
            if not idle:
                sums.add(s)
                tokens += b.num_tokens
        all_reduce_sum_(sums.values, self.info)
        # Pre-clipping norm, logged: a norm far above the clip means the clip, not the lr, sets the step size.
        self.grad_norm = self.engine.clip_grad_norm(cfg.grad_clip if cfg.grad_clip and cfg.grad_clip > 0
                                                    else float("inf"))
        self._check_finite(sums)  # before the update: the weights and the last checkpoint stay intact
        self.optimizer.step()
        self.optimizer.schedule_step()
        t = torch.tensor([tokens, skipped], dtype=torch.float64)
        all_reduce_sum_(t, self.info)
        self.skipped_now += int(t[1].item())
        return sums, int(t[0].item())

    def _check_finite(self, sums: StepSums) -> None:
        """Stop (every rank sees the same reduced numbers) at a step whose loss or gradients are not finite."""
        if math.isfinite(self.grad_norm) and bool(torch.isfinite(sums.values).all()):
            return
        grads = ((n, p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad)  # FSDP: this rank's shard
                 for n, p in self.model.named_parameters() if p.grad is not None)
        found = first_non_finite(grads)
        what = f"the gradient of '{found[0]}' ({found[1]} of {found[2]} values)" if found else "the loss"
        raise Eagle3InputError(
            f"training stopped at step {self.step + 1}: {what} is NaN/inf (loss per TTT step "
            f"{[round(v, 4) for v in sums.values[0].tolist()]}, gradient norm {self.grad_norm}); this step was not "
            f"applied and the checkpoints in {self.out} are intact: lower train.lr or set train.grad_clip > 0, "
            f"then rerun with --resume")

    @torch.no_grad()
    def evaluate(self, data: TrainingSamples | None = None) -> dict[str, float]:
        data = data or self.val_data
        if data is None:
            return {}
        self.engine.module.eval()
        plan = plan_batches(data.lengths, self.cfg.token_budget, 0, 0, shuffle=False)
        if self.cfg.max_eval_batches:
            plan = plan[:self.cfg.max_eval_batches]
        sums = StepSums(self.cfg.ttt_steps)
        skipped_before = data.skipped
        mine = plan[self.info.rank::self.info.world_size]
        for i in range(self._slots(plan)):
            # None: every sample skipped by the source (counted there), or this rank's share ended
            batch = data.batch(mine[i]) if i < len(mine) else None
            idle = batch is None
            batch = self._idle_batch() if idle else batch.to(self.device, torch.float32)
            denom = method_denominators(self.cfg.method, batch, self.cfg.ttt_steps).to(self.device)
            _, s = self._forward(batch, denom)
            if not idle:
                sums.add(s)
        all_reduce_sum_(sums.values, self.info)
        skipped = all_reduce_sum_(torch.tensor([data.skipped - skipped_before], dtype=torch.float64), self.info)
        self.skipped_now += int(skipped.item())
        return sums.summary()

    def _best_key(self) -> str:
        """Rank at the k that export and serving use (as far as training-time test estimates it)."""
        return f"accept_len_k{min(self.cfg.ttt_steps, NUM_SPECULATIVE_TOKENS)}"

    @property
    def early_stopped(self) -> bool:
        """train.early_stop validations in a row brought no better estimate (a resume cannot change the setting)."""
        return bool(self.cfg.early_stop) and self.stale_validations >= self.cfg.early_stop

    def maybe_best(self, val: dict[str, float]) -> None:
        key = self._best_key()
        if key in val and val[key] <= self.best.get(key, -1.0):
            self.stale_validations += 1
            if self.early_stopped:
                log.info("early stop at step %d: %d validations without a better %s than %.4f (step %d)",
                         self.step, self.stale_validations, key, self.best[key], self.best["step"])
        if key in val and val[key] > self.best.get(key, -1.0):
            self.stale_validations = 0
            self.best = {key: val[key], "step": self.step}
            weights = self.engine.full_state_dict()
            if self.info.is_main:
                ckpt.save_checkpoint(self.out / "checkpoints" / "best", self.model, None, self.metadata("best"),
                                     weights=weights)
            barrier(self.info)

    def _set_aside(self) -> None:
        """--overwrite: move the run in --out aside (never deleted) so this one starts from an empty directory."""
        barrier(self.info)  # every rank has seen the old checkpoints before rank 0 moves them
        if self.info.is_main:
            aside = set_aside(self.out)
            log.warning("--overwrite: moved the run in %s to %s", self.out, aside)
        barrier(self.info)

    def release(self) -> None:
        """Drop the draft, its engine and optimizer: DDP's reducer and FSDP's mesh hold the process group, which must
        go before the group is destroyed (a gloo group whose last holder went after destroy_process_group hung
        joining its threads at exit). An exception's traceback may still hold this trainer, not these."""
        self.engine = self.model = self.optimizer = None
        gc.collect()

    # --- the loop -----------------------------------------------------------------------------------------------
    def run(self) -> dict[str, Any]:
        try:
            if not self.info.is_main:
                return self._run()
            # rank 0 holds --out for the whole run: a second run into it stops instead of writing the same files
            claim_output_dir(self.out, *OUTPUT, written_by_train, writes=WRITES)
            with output_lock(self.out, OUTPUT[1]):
                result = self._run()
                self.metrics.close()  # the trackers' last writes, still under the lock
        except BaseException:
            self.metrics.close(ok=False)  # the trackers' runs end as failed
            raise
        print("\n".join(["training logs and plots:", *self.metrics.where()]), file=sys.stderr, flush=True)
        return result

    def _run(self) -> dict[str, Any]:
        cfg = self.cfg
        barrier(self.info)
        if cfg.resume:
            if not checkpointing.resume(self):
                log.info("--resume: no checkpoint in %s, starting fresh", self.out)
        elif ckpt.latest_checkpoint(self.out) is not None:
            if not cfg.overwrite:
                raise Eagle3InputError(f"{self.out} already holds checkpoints: pass --resume to continue that run, "
                                       f"--overwrite to set it aside and start over, or choose another --out")
            self._set_aside()
        self.metrics.start(self.step, cfg.trackers(), cfg.to_dict())
        if self.info.is_main:
            write_json(self.out / "training_metadata.json", self.metadata("running"))
        bar = progress(total=self.total_steps, desc="train", unit="step", initial=self.step,
                       disable=not self.info.is_main)
        t0, tok0 = time.time(), self.tokens_seen
        window = StepSums(cfg.ttt_steps)
        eval_every = cfg.eval_every or self.steps_per_epoch
        stop_at = min(self.total_steps, self.step + cfg.stop_after) if cfg.stop_after else self.total_steps
        while self.step < stop_at and not self.early_stopped:
            plan = plan_batches(self.train_data.lengths, cfg.token_budget, cfg.seed, self.epoch)
            usable = self._usable_batches(plan)
            if usable == 0:
                raise Eagle3InputError(f"{len(plan)} batches per epoch cannot feed grad_accum x world size = "
                                       f"{self.micro_per_step} micro-batches per step: lower train.token_budget "
                                       f"or train.grad_accum, or add data")
            mps = self.micro_per_step
            # Online/hybrid: the next steps' hidden states are requested while this one trains.
            steps = [plan[i:i + mps] for i in range(self.batch_in_epoch, usable - mps + 1, mps)]
            feed = Prefetcher(self.fetch_step, steps,
                              cfg.prefetch if states_mode(cfg.hidden_states_mode).served else 0)
            try:
                while self.batch_in_epoch + mps <= usable and self.step < stop_at and not self.early_stopped:
                    window = self._one_step(feed, window, t0, tok0, bar, eval_every, stop_at)
            finally:
                self.timing["fetch_wait_s"] += feed.wait_s
                feed.close()
            if self._close_finished_epoch(usable) and self.step < self.total_steps and not self.early_stopped:
                checkpointing.save(self, "end of epoch")
        if self.batch_in_epoch:  # resumed from a periodic checkpoint of the run's last step: the loop did not run
            self._close_finished_epoch(self._usable_batches())
        bar.close()
        return self._finish(t0, tok0)

    def _close_finished_epoch(self, usable: int) -> bool:
        """Move on to the next epoch when this one has no whole optimizer step left."""
        if self.batch_in_epoch + self.micro_per_step <= usable:
            return False
        self.epoch += 1
        self.batch_in_epoch = 0
        return True

    def _usable_batches(self, plan: list | None = None) -> int:
        """Micro-batches of this epoch's plan that fill whole optimizer steps."""
        if plan is None:
            plan = plan_batches(self.train_data.lengths, self.cfg.token_budget, self.cfg.seed, self.epoch)
        return len(plan) - len(plan) % self.micro_per_step

    def _one_step(self, feed: Prefetcher, window: StepSums, t0: float, tok0: int, bar, eval_every: int,
                  stop_at: int) -> StepSums:
        """Train on the next fetched step; log, validate and save on schedule. Returns the metrics window."""
        cfg = self.cfg
        micro, batches, skipped = next(feed)
        t_train = time.perf_counter()
        sums, tokens = self.train_step(micro, batches, skipped)
        if self.release_host_memory is not None:
            self.release_host_memory()
        self.timing["train_s"] += time.perf_counter() - t_train
        self.batch_in_epoch += self.micro_per_step
        self.step += 1
        self.tokens_seen += tokens
        window.add(sums.values)
        rate = (self.tokens_seen - tok0) / max(1e-9, time.time() - t0)
        bar.update(1)
        if self.step % cfg.log_every == 0 or self.step == self.total_steps:
            summary = window.summary()
            self.last_train = {**summary, "lr": self.optimizer.last_lr(), "tokens_per_s": rate,
                               "grad_norm": self.grad_norm, "skipped_samples": self.skipped_samples()}
            self.log_metrics("train", self.last_train)
            bar.set_postfix(loss=f"{summary['loss']:.3f}", acc0=f"{summary['acc_0']:.3f}",
                            tok_s=f"{rate:.0f}")
            window = StepSums(cfg.ttt_steps)
        if self.step % eval_every == 0 and self.step < self.total_steps:
            self._validate()
        if cfg.save_every and self.step % cfg.save_every == 0:
            checkpointing.save(self, "periodic")
        elif self.step < stop_at and checkpointing.checkpoint_due(self):
            checkpointing.save(self, f"{cfg.checkpoint_every_minutes:g} min since the last checkpoint")
        return window

    def _finish(self, t0: float, tok0: int) -> dict[str, Any]:
        try:
            return self._finish_run(t0, tok0)
        finally:
            for data in (self.train_data, self.val_data):
                if data is not None:
                    data.close()

    def _finish_run(self, t0: float, tok0: int) -> dict[str, Any]:
        # stopped on request (stop_after): checkpoint and leave; an early stop (train.early_stop) finishes the run
        stopped = self.step < self.total_steps and not self.early_stopped
        # A run killed after its last checkpoint but before final/ resumes here with that step validated and logged.
        if not stopped and self.validated_step != self.step:
            self._validate()
        checkpointing.save(self, "stop_after" if stopped else "end of training")
        train_rate = 0.0 if stopped else (self.tokens_seen - tok0) / max(1e-9, time.time() - t0)
        result = {"out": str(self.out), "step": self.step, "train": self.last_train, "validation": self.last_val,
                  "best": self.best, "tokens_per_s": train_rate, "skipped_samples": self.skipped_samples(),
                  "timing": timing_record(self.timing, self.train_data.source)}
        if stopped:
            return {**result, "stopped": True}
        result["final_checkpoint"] = str(self.out / "checkpoints" / f"step-{self.step:07d}")
        weights = self.engine.full_state_dict()
        if self.info.is_main:
            meta = self.metadata("finished")
            meta["run"]["tokens_per_s"] = train_rate
            meta["run"]["timing"] = result["timing"]
            write_json(self.out / "training_metadata.json", meta)
            ckpt.save_checkpoint(self.out / "final", self.model, None, meta, weights=weights)
            result["final"] = str(self.out / "final")
            from eagle3_train.train.plots import plot_metrics

            plot_metrics(self.out / "metrics.jsonl", self.out / "metrics.png")
        return result

    def _validate(self) -> None:
        val = self.evaluate()
        self.validated_step = self.step
        if val:
            self.last_val = val
            self.log_metrics("validation", val)
            self.maybe_best(val)
            k = self.cfg.ttt_steps
            log.info("step %d validation: loss %.4f, acc_0 %.3f, alpha_0 %.3f, est. acceptance length (%s) %.3f "
                     "at temperature 0 (argmax), %.3f at temperature 1 (alpha, k=%d)", self.step, val["loss"],
                     val["acc_0"], val["alpha_0"], self._best_key().removeprefix("accept_len_"),
                     val[self._best_key()], val[f"accept_len_alpha_k{k}"], k)


def train(cfg: TrainConfig, verifier: Verifier | None = None) -> dict[str, Any]:
    """Train (or finetune) a draft; `verifier`: the one the caller resolved (default: `cfg.verifier`, else the one
    the hidden states or prepared data record)."""
    trainer = Trainer(cfg, verifier)
    try:
        return trainer.run()
    finally:
        trainer.release()
        destroy(trainer.info)
