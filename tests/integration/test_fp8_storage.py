"""fp8 (e4m3) storage of hidden states with a per-row scale: error bounds on real SmolLM2 activations (massive
activations included), extract writes it, the shard reader decodes it, training reads it."""

from __future__ import annotations

import json

import pytest
import torch

from eagle3_train.hidden_states import fp8
from eagle3_train.hidden_states.extract import extract
from eagle3_train.hidden_states.store import HiddenStatesReader

# e4m3 keeps 3 mantissa bits: rounding error <= 2^-4 relative above the smallest normal (2^-6 x scale), and
# <= half a subnormal step (2^-10 x scale) below it.
REL, ABS_STEPS = 2.0 ** -4, 2.0 ** -10


def assert_within_e4m3_bounds(x: torch.Tensor, groups: int) -> torch.Tensor:
    q, scale = fp8.encode_rows(x, groups)
    assert q.dtype == fp8.FP8 and scale.shape == (x.shape[0], groups)
    back = fp8.decode_rows(q, scale, torch.float32)
    xf = x.float()
    per_elem_scale = scale.repeat_interleave(x.shape[1] // groups, dim=1)
    bound = torch.maximum(REL * xf.abs(), ABS_STEPS * per_elem_scale) * (1 + 1e-6)
    assert bool(((back - xf).abs() <= bound).all())
    return back


@pytest.fixture(scope="module")
def smollm2_states(smollm2_dir, smollm2_tokenizer):
    """Aux (inputs of layers 2, 15, 27) and final-norm states of SmolLM2-135M-Instruct on a few chat prompts."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32).eval()
    texts = ["Explain why the sky is blue in two sentences.", "def fib(n):\n    return",
             "List three prime numbers greater than 100 and say why they are prime."]
    aux, final = [], []
    with torch.inference_mode():
        for t in texts:
            ids = smollm2_tokenizer.apply_chat_template([{"role": "user", "content": t}], add_generation_prompt=True,
                                                        return_tensors="pt", return_dict=True)["input_ids"]
            out = model.model(input_ids=ids, output_hidden_states=True)
            aux.append(torch.cat([out.hidden_states[i][0] for i in (2, 15, 27)], dim=-1))
            final.append(out.last_hidden_state[0])
    return torch.cat(aux), torch.cat(final), model.config.hidden_size


@pytest.mark.slow
def test_round_trip_error_on_smollm2_activations(smollm2_states):
    aux, final, hidden = smollm2_states
    # The residual stream of SmolLM2 has massive activations: a few channels far above the rest of the row.
    peak_ratio = (aux.abs().amax(dim=-1) / aux.abs().median(dim=-1).values).max()
    assert peak_ratio > 100
    for x, groups in ((aux.bfloat16(), 3), (final.bfloat16(), 1)):
        back = assert_within_e4m3_bounds(x, groups)
        rel = (back - x.float()).norm(dim=-1) / x.float().norm(dim=-1)
        assert float(rel.max()) < 0.05  # each token's state within 5% (L2)
        cos = torch.nn.functional.cosine_similarity(back, x.float(), dim=-1)
        assert float(cos.min()) > 0.998


def test_per_row_and_layer_scales_protect_tokens_next_to_a_massive_activation(smollm2_states):
    aux, _, hidden = smollm2_states
    x = aux[:8].clone()
    x[3, 7] = 5000.0  # one token with one huge channel in the first aux layer
    back = assert_within_e4m3_bounds(x, 3)
    others = torch.ones(8, dtype=torch.bool)
    others[3] = False
    # Other tokens, and the other layers of the same token, keep their own scale: unaffected by the outlier.
    assert torch.equal(back[others], fp8.decode_rows(*fp8.encode_rows(aux[:8][others], 3), torch.float32))
    q_one, s_one = fp8.encode_rows(x[3:4, hidden:], 2)
    assert torch.equal(back[3, hidden:], fp8.decode_rows(q_one, s_one, torch.float32)[0])


def test_zero_rows_and_group_checks():
    q, s = fp8.encode_rows(torch.zeros(2, 6), 3)
    assert torch.equal(fp8.decode_rows(q, s, torch.float32), torch.zeros(2, 6))
    with pytest.raises(ValueError, match="equal groups"):
        fp8.encode_rows(torch.ones(2, 7), 3)


@pytest.mark.slow
def test_extract_stores_fp8_and_training_reads_it(tiny_stages, tmp_path):
    from support.stage_helpers import train_config

    from eagle3_train.train.trainer import train

    root, verifier = tiny_stages
    out = tmp_path / "hidden-fp8"
    manifest = extract(root / "prepared", verifier, out, dtype="float8_e4m3", token_budget=2048)
    ref_manifest = json.loads((root / "hidden" / "manifest.json").read_text())  # float32 states, same data
    hidden = manifest["hidden_size"]
    assert manifest["dtype"] == "float8_e4m3" and manifest["bytes_per_token"] == 4 * hidden + 16
    assert "fp8_scales" in manifest
    for split in ("train", "validation"):
        fp, ref = HiddenStatesReader(out, split), HiddenStatesReader(root / "hidden", split)
        assert fp.sample_indices == ref.sample_indices
        for i in fp.sample_indices[:4]:
            got, want = fp.load(i), ref.load(i)
            for name in ("aux", "final"):
                assert got[name].dtype == torch.bfloat16 and got[name].shape == want[name].shape
                w = want[name].float()
                assert bool(((got[name].float() - w).abs() <= 0.07 * w.abs().amax(dim=-1, keepdim=True)).all())
    fp_bytes = sum(s["bytes"] for s in manifest["splits"].values())
    ref_bytes = sum(s["bytes"] for s in ref_manifest["splits"].values())
    assert fp_bytes < 0.3 * ref_bytes  # 1 byte per element against float32's 4 (plus scales and index tensors)

    result = train(train_config(root, tmp_path / "run", hidden_states=str(out), max_steps=4))
    assert result["step"] == 4 and all(torch.isfinite(torch.tensor(v)) for v in result["validation"].values()
                                       if isinstance(v, float))
