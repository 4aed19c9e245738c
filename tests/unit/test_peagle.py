"""P-EAGLE (train.method peagle, model/draft_methods.py) on tiny tensors: its training-time-test step j at position t
is the parallel slot j of a draft round that vLLM runs from position t, its metrics and loss count what that round
would accept, and its own parameter (mask_hidden) learns while the verifier's embedding stays frozen.

The reference lays a round out as vLLM 0.32's parallel drafting does (`set_inputs_first_pass`): the verified
positions 0..t with the next tokens and their fused verifier features, then k-1 mask slots at positions t+1..t+k-1
reading the mask token and fuse(mask_hidden), all in one causal forward with a KV cache (`Eagle3Draft.forward_cached`).
"""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from support.tiny_ttt import STEPS, V, forward_and_reference, tiny_batch, tiny_draft

from eagle3_train.model.draft import Eagle3Draft
from eagle3_train.model.optimizer_groups import muon_parameter_names
from eagle3_train.train.objective import Objective
from eagle3_train.train.targets import verifier_targets
from eagle3_train.train.ttt import supervised_counts, ttt_forward
from eagle3_train.utils.io import Eagle3InputError

MASK = 6  # a verifier-vocabulary token (not one the draft vocabulary holds)


def tiny_peagle(seed: int = 0) -> Eagle3Draft:
    eagle = tiny_draft(seed)
    model = Eagle3Draft(dataclasses.replace(eagle.config, method="peagle", mask_token_id=MASK))
    model.load_state_dict({**eagle.state_dict(), "mask_hidden": model.mask_hidden.detach()})
    with torch.no_grad():
        model.mask_hidden.normal_(0.0, 1.0, generator=torch.Generator().manual_seed(seed))
    return model


def parallel_round(model: Eagle3Draft, aux: torch.Tensor, ids: torch.Tensor, t: int, k: int) -> torch.Tensor:
    """[k, Vd] draft logits of a round drafted from position t (verified tokens up to t+1), laid out by hand."""
    n = k - 1
    h = torch.cat([model.fuse(aux[None, :t + 1]), model.fuse(model.mask_hidden).expand(1, n, -1)], dim=1)
    step_ids = torch.cat([ids[None, 1:t + 2], torch.full((1, n), MASK)], dim=1)
    logits, _, _ = model.forward_cached(h, step_ids, torch.arange(t + 1 + n)[None], None)
    return logits[0, -k:]


def reference_sums(model, batch, lm_head, draft_ids, t2d) -> torch.Tensor:
    """[5, STEPS] loss_sum, supervised, valid, correct, full_correct position by position: full_correct is every
    slot so far right (a parallel draft reads no drafted token, so the data's tokens never stop its chain)."""
    sums = torch.zeros(5, STEPS, dtype=torch.float64)
    B, L = batch.input_ids.shape
    for b in range(B):
        final = batch.final[b]
        target = torch.softmax(final @ lm_head[draft_ids].T, dim=-1)
        valid = t2d[(final @ lm_head.T).argmax(-1)]
        for t in range(L - 2):
            k = min(STEPS, L - 2 - t)
            logits = parallel_round(model, batch.aux[b], batch.input_ids[b], t, k)
            chain = True
            for j, lg in enumerate(logits):
                if not batch.loss_mask[b, t + 2 + j]:
                    chain = False
                    continue
                p = t + 1 + j
                ce = -(target[p] * torch.log_softmax(lg, -1)).sum()
                correct = bool(valid[p]) and int(lg.argmax()) == int(target[p].argmax())
                chain = chain and correct
                sums[:, j] += torch.tensor([float(ce) * bool(valid[p]), 1, bool(valid[p]), correct, chain],
                                           dtype=torch.float64)
    return sums


def test_ttt_steps_are_the_parallel_slots_vllm_drafts():
    expected, loss, sums, denominators = forward_and_reference(tiny_peagle(1).eval(), reference_sums, 3)
    assert expected[4, -1] > 0  # some rounds are right through the last slot
    torch.testing.assert_close(sums[1:5], expected[1:5], rtol=0, atol=0)
    torch.testing.assert_close(sums[0], expected[0], rtol=1e-5, atol=1e-5)
    assert loss.item() == pytest.approx(float((expected[0] / denominators).sum()), rel=1e-5)


def test_offline_proposal_is_the_one_forward_vllm_runs():
    model = tiny_peagle(2).eval()
    batch, *_ = tiny_batch(2)
    aux, ids, t, k = batch.aux[0], batch.input_ids[0], 8, STEPS
    with torch.no_grad():
        drafted, kv = model.method.propose(model, model.fuse(aux[None, :t + 1]), ids[None, 1:t + 2],
                                           torch.arange(t + 1)[None], None, k, model.draft_token_ids())
        torch.testing.assert_close(torch.stack(drafted), parallel_round(model, aux, ids, t, k))
    assert kv[0][0].shape[2] == t + k  # the caller crops the mask slots back off


def test_mask_hidden_learns_and_the_embedding_stays_the_verifiers():
    model = tiny_peagle(1)
    batch, lm_head, draft_ids, t2d = tiny_batch(1)
    targets = verifier_targets(batch.final, batch.loss_mask, lm_head, draft_ids, t2d)
    loss, _ = ttt_forward(model, batch, targets, Objective(STEPS, (1.0, 0.8, 0.64)),
                          supervised_counts(batch.loss_mask, STEPS))
    loss.backward()
    assert model.mask_hidden.grad is not None and model.mask_hidden.grad.abs().sum() > 0
    assert not model.embed_tokens.weight.requires_grad
    assert "mask_hidden" in model.trainable_state_dict()
    # a vector, not a matrix: AdamW's, like the norms (Muon would scale it to a unit update direction)
    assert "mask_hidden" not in muon_parameter_names(model) and "fc.weight" in muon_parameter_names(model)


def test_the_mask_token_belongs_to_the_method():
    cfg = tiny_draft().config
    with pytest.raises(Eagle3InputError, match="method peagle needs mask_token_id"):
        dataclasses.replace(cfg, method="peagle")
    with pytest.raises(Eagle3InputError, match=f"in 0..{V - 1}"):
        dataclasses.replace(cfg, method="peagle", mask_token_id=V)
    with pytest.raises(Eagle3InputError, match="not eagle3"):
        dataclasses.replace(cfg, mask_token_id=MASK)
    with pytest.raises(Eagle3InputError, match="draft method must be one of eagle3, peagle"):
        dataclasses.replace(cfg, method="medusa")


def test_every_vllm_command_we_write_drafts_in_parallel(tmp_path):
    """A P-EAGLE export's speculative config and printed serve line carry parallel_drafting (vLLM's silent
    sequential fallback otherwise); an EAGLE-3 export's do not. Either format is recognised from its config.json."""
    from eagle3_train.export.exporter import serve_command
    from eagle3_train.model.draft_methods import method_of_config
    from eagle3_train.serving.vllm_options import speculative_config

    configs = {"eagle3": {"architectures": ["LlamaForCausalLMEagle3"]},
               "peagle-eagle": {"architectures": ["LlamaForCausalLMEagle3"], "mask_token_id": MASK},
               "peagle-speculators": {"speculators_model_type": "peagle", "mask_token_id": MASK}}
    for name, config in configs.items():
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text(json.dumps(config))
        parallel = name != "eagle3"
        assert (method_of_config(config).name == "peagle") is parallel
        assert speculative_config(tmp_path / name, 3).get("parallel_drafting") is (True if parallel else None)
    line = serve_command(tmp_path / "peagle-eagle", "eagle", "VERIFIER", 3, method="peagle")
    assert '"parallel_drafting": true' in line and '"method": "eagle3"' in line
    assert "parallel_drafting" not in serve_command(tmp_path / "eagle3", "eagle", "VERIFIER", 3)


def test_engine_verdicts():
    from eagle3_train.model.engines import engine_support

    cfg = tiny_peagle().config
    eagle = engine_support(cfg, "eagle")
    assert eagle["vllm"]["serves_as_trained"] and not eagle["sglang"]["serves_as_trained"]
    assert "no parallel drafting" in eagle["sglang"]["reasons"][0]
    with_fc_norm = engine_support(dataclasses.replace(cfg, fc_norm=True), "speculators")
    assert not with_fc_norm["vllm"]["serves_as_trained"] and "fc_norm" in with_fc_norm["vllm"]["reasons"][0]
    assert engine_support(dataclasses.replace(cfg, fc_norm=True), "eagle")["vllm"]["serves_as_trained"]
