"""Training-time test: unroll the draft K steps on a batch and return the weighted loss (`train.loss`) and metrics.

Step j at position t reads token x_{t+1+j} and (j=0) the fused verifier features of position t or (j>0) the draft's
own hidden state from step j-1 (P-EAGLE: a mask token and the fused `mask_hidden`, model/draft_methods.py); its RoPE
position is t+j; its target is the verifier distribution at position t+1+j
(over x_{t+2+j}), supervised when x_{t+2+j} is an assistant token. Ground-truth tokens are fed to later steps.

Metrics per step j (docs/METRICS.md): full_acc_j (argmax match, chained: temperature 0) and accept_len_kN from it;
alpha_j = mean Σ min(p, q) against the verifier's unrenormalised distribution (temperature 1, draft sampled) and
accept_len_alpha_kN = 1 + Σ_j Π_{i<=j} alpha_i; p_draft_j = mean p(argmax q) (temperature 1, greedy draft, as vLLM
drafts by default) and accept_len_pdraft_kN from it likewise.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
import torch.utils.checkpoint

from eagle3_train.model.draft import Eagle3Draft
from eagle3_train.model.verifier_head import LOGITS_CHUNK_ELEMENTS, chunk_rows
from eagle3_train.train.data import Batch
from eagle3_train.train.losses import acceptance, row_loss, soft_cross_entropy
from eagle3_train.train.objective import Objective
from eagle3_train.train.targets import Targets


def supervised_counts(loss_mask: torch.Tensor, steps: int) -> torch.Tensor:
    """Positions supervised at each TTT step (depends on the loss mask only): the loss denominators."""
    return torch.stack([loss_mask[:, 2 + j:].sum() for j in range(steps)]).double()


NUM_SUMS = 7


@dataclass
class StepSums:
    """Additive metric sums over a set of batches; reduced across ranks with one all_reduce."""
    steps: int
    # rows: loss_sum, supervised, valid, correct, full_correct, alpha_sum, p_draft_sum
    values: torch.Tensor = field(init=False)

    def __post_init__(self) -> None:
        self.values = torch.zeros(NUM_SUMS, self.steps, dtype=torch.float64)

    def add(self, other: torch.Tensor) -> None:
        self.values += other.detach().to("cpu", torch.float64)

    def summary(self, prefix: str = "") -> dict[str, float]:
        loss, sup, valid, correct, full, alpha, p_draft = self.values
        out: dict[str, float] = {}
        est = 1.0
        est_alpha, chain_alpha = 1.0, 1.0
        est_pdraft, chain_pdraft = 1.0, 1.0
        for j in range(self.steps):
            s = max(sup[j].item(), 1.0)
            out[f"{prefix}loss_{j}"] = loss[j].item() / s
            out[f"{prefix}acc_{j}"] = correct[j].item() / s
            out[f"{prefix}full_acc_{j}"] = full[j].item() / s
            out[f"{prefix}coverage_{j}"] = valid[j].item() / s
            est += full[j].item() / s
            out[f"{prefix}accept_len_k{j + 1}"] = est  # 1 + sum_{i<=j} full_acc_i (the +1 is the bonus token)
            # Temperature 1: step j is reached only if steps 0..j-1 accepted, taken as independent (no per-row chain)
            out[f"{prefix}alpha_{j}"] = alpha[j].item() / s
            chain_alpha *= out[f"{prefix}alpha_{j}"]
            est_alpha += chain_alpha
            out[f"{prefix}accept_len_alpha_k{j + 1}"] = est_alpha
            out[f"{prefix}p_draft_{j}"] = p_draft[j].item() / s
            chain_pdraft *= out[f"{prefix}p_draft_{j}"]
            est_pdraft += chain_pdraft
            out[f"{prefix}accept_len_pdraft_k{j + 1}"] = est_pdraft
        out[f"{prefix}loss"] = sum(out[f"{prefix}loss_{j}"] for j in range(self.steps)) / self.steps
        return out


def _advance_chain(chain: torch.Tensor, b_idx: torch.Tensor, t_idx: torch.Tensor, n: int,
                   correct: torch.Tensor, carry: torch.Tensor) -> torch.Tensor:
    """After a TTT step: position t's chain [B, L] holds on if it held, the step was right there and (`carry`) the
    next step is fed what serving would feed it; positions not scored at this step (the first n are the step's) break
    theirs. Returns the chain of the step's rows up to this step."""
    ok = chain[b_idx, t_idx] & correct
    chain[:, :n] = False
    chain[b_idx, t_idx] = ok & carry
    return ok


def _head_loss(model: Eagle3Draft, hidden: torch.Tensor, all_probs: torch.Tensor, rows: torch.Tensor,
               valid: torch.Tensor, in_mass: torch.Tensor, loss: str = "ce", loss_mix: float = 0.5,
               scored: torch.Tensor | None = None
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Summed loss over valid rows, the same sum over the scored rows (a metric), the draft's argmax (draft-vocab
    index) of every row, and the summed alpha and p_draft metrics over the scored rows (`scored` [rows] bool: the
    rows the metrics count; None: all).

    The target rows are gathered here, not by the caller: under checkpointing the inputs are kept for backward, and
    a gathered [rows, Vd] copy per TTT step was the largest thing kept (the shared `all_probs` costs nothing extra).
    """
    p = all_probs[rows].float()
    # The loss first: recomputing for backward stops once the last tensor backward needs is recomputed (checkpoint
    # early stop), so the metrics below are computed once, not twice. No name holds the logits: backward does not
    # need them, so they are freed before the metrics' [rows, Vd] temporaries exist.
    if loss == "ce":
        per_row, q = soft_cross_entropy(model.logits(hidden).float(), p)
    else:
        log_q = torch.log_softmax(model.logits(hidden).float(), dim=-1)
        per_row, q = row_loss(log_q, p, loss, loss_mix), log_q.detach().exp()
    loss_sum = (per_row * valid).sum()
    with torch.no_grad():  # metrics against the verifier's full-vocab probabilities on the draft vocab
        w = torch.ones_like(per_row) if scored is None else scored.to(per_row.dtype)
        scored_loss = (per_row * valid * w).sum()
        draft_argmax = q.argmax(-1)
        p_full = p * in_mass[rows].unsqueeze(-1)
        alpha_sum = (acceptance(p_full, q) * w).sum()
        p_draft_sum = (p_full.gather(-1, draft_argmax.unsqueeze(-1)).squeeze(-1) * w).sum()
    return loss_sum, scored_loss, draft_argmax, alpha_sum, p_draft_sum


def step_loss(model: Eagle3Draft, hidden: torch.Tensor, targets: Targets, rows: torch.Tensor, valid: torch.Tensor,
               scored: torch.Tensor | None, objective: Objective
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """`_head_loss` over a step's rows; under `checkpoint_loss`, in pieces of LOGITS_CHUNK_ELEMENTS logits each
    recomputed in backward, so only one piece's [rows, Vd] temporaries (four fp32 at once, ~1 GB) exist at a time
    whatever the sample's length (a 16K-token step of a full 163,840-row vocabulary would hold 43 GB at once)."""
    options = (objective.loss, objective.loss_mix)
    if not (objective.checkpoint_loss and torch.is_grad_enabled()):
        return _head_loss(model, hidden, targets.probs, rows, valid, targets.in_mass, *options, scored)
    n = chunk_rows(max(1, len(rows)), targets.probs.shape[1], LOGITS_CHUNK_ELEMENTS)
    # Recompute the [rows, Vd] logits in backward instead of keeping them (and their log-softmax) for every TTT
    # step: the largest activations of a step, for one extra lm_head matmul.
    parts = [torch.utils.checkpoint.checkpoint(
        _head_loss, model, hidden[s:s + n], targets.probs, rows[s:s + n], valid[s:s + n], targets.in_mass, *options,
        None if scored is None else scored[s:s + n], use_reentrant=False) for s in range(0, max(1, len(rows)), n)]
    if len(parts) == 1:
        return parts[0]
    loss_sum, scored_loss, argmax, alpha_sum, p_draft_sum = zip(*parts)
    return (torch.stack(loss_sum).sum(), torch.stack(scored_loss).sum(), torch.cat(argmax),
            torch.stack(alpha_sum).sum(), torch.stack(p_draft_sum).sum())


def ttt_forward(model: Eagle3Draft, batch: Batch, targets: Targets, objective: Objective,
                denominators: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Return (loss to backpropagate, metric sums [NUM_SUMS, steps]).

    loss = sum_j w_j * sum_{valid t} loss_j(t) / denominators[j], so that summing over micro-batches and ranks gives
    the same gradient as one big batch (loss_j: `objective.loss`, see train/losses.py). The metrics count the
    positions of `batch.scored_mask` when the batch has one (training on every token still reports the assistant
    tokens), else those of the loss mask.
    """
    B, L = batch.input_ids.shape
    method = model.method  # what steps j >= 1 read (model/draft_methods.py)
    steps, step_weights = objective.steps, objective.step_weights
    checkpoint_mlp = objective.checkpoint_mlp
    h = model.fuse(batch.aux)
    caches = model.new_ttt_caches()
    positions = torch.arange(L, device=h.device).expand(B, L)
    chain_ok = torch.ones(B, L, dtype=torch.bool, device=h.device)
    draft_ids = model.draft_token_ids()
    sums = torch.zeros(NUM_SUMS, steps, dtype=torch.float64, device=h.device)
    loss = h.new_zeros((), dtype=torch.float32)
    ids_j = F.pad(batch.input_ids[:, 1:], (0, 1))
    for j in range(steps):
        # positions t with a target token t+2+j inside the sequence; a step with none still runs (no rows, no loss):
        # under FSDP every rank must call each unit equally often, whatever its batch's length
        n = max(0, L - 2 - j)
        out = model.ttt_step(h, ids_j, positions + j, caches, recompute_mlp=checkpoint_mlp)
        sup = batch.loss_mask[:, 2 + j:2 + j + n]
        b_idx, t_idx = sup.nonzero(as_tuple=True)
        rows = targets.row_of[b_idx, t_idx + 1 + j]
        valid = targets.in_vocab[rows]
        scored = None if batch.scored_mask is None else batch.scored_mask[:, 2 + j:2 + j + n][b_idx, t_idx]
        loss_sum, scored_loss, draft_argmax, alpha_sum, p_draft_sum = step_loss(
            model, out[b_idx, t_idx], targets, rows, valid, scored, objective)
        loss = loss + step_weights[j] * loss_sum / denominators[j].clamp(min=1).to(loss.dtype)
        with torch.no_grad():
            match = draft_argmax == targets.argmax[rows]
            if scored is not None:  # the metrics count the scored rows only
                valid = valid & scored
            correct = match & valid
            # Served greedily, the chain goes on with the verifier's argmax; the next TTT step reads the data token.
            # Where the two differ (original answers, not the verifier's) the next step is not what serving runs,
            # so the chain metrics stop there instead of following the data.
            # A method whose steps do not read the drafted token (P-EAGLE) is served what it was trained on.
            follows = targets.in_vocab[rows] & (
                draft_ids[targets.argmax[rows]] == batch.input_ids[b_idx, t_idx + 2 + j]) if method.chained \
                else torch.ones_like(correct)
            ok = _advance_chain(chain_ok, b_idx, t_idx, n, correct, follows)
            counted = float(len(rows)) if scored is None else scored.sum().double()
            sums[:, j] = torch.stack([scored_loss.double(), torch.as_tensor(counted, device=h.device,
                                      dtype=torch.float64), valid.sum().double(), correct.sum().double(),
                                      ok.sum().double(), alpha_sum.double(), p_draft_sum.double()])
        if j + 1 < steps:  # what step j+1 reads: the data's next tokens and the draft's output, or the method's own
            h, ids_j = method.later_step(model, out, F.pad(batch.input_ids[:, 2 + j:], (0, 2 + j)))
    return loss, sums
