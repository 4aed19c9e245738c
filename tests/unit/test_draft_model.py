"""The draft module: training-time test must compute exactly what chain decoding with a KV cache (vLLM) computes."""

import pytest
import torch

from eagle3_train.model.attention import TTTAttention
from eagle3_train.model.config import DraftConfig
from eagle3_train.model.draft import Eagle3Draft


def tiny_config(**kw) -> DraftConfig:
    base = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16, intermediate_size=96,
                vocab_size=200, draft_vocab_size=50, rope_theta=10000.0, aux_layer_ids=(1, 2, 3),
                verifier_num_layers=6)
    base.update(kw)
    return DraftConfig(**base)


def ttt_logits(model: Eagle3Draft, aux: torch.Tensor, ids: torch.Tensor, steps: int) -> list[torch.Tensor]:
    B, L = ids.shape
    h = model.fuse(aux)
    caches = model.new_ttt_caches()
    pos = torch.arange(L).expand(B, L)
    out = []
    for j in range(steps):
        ids_j = torch.nn.functional.pad(ids[:, 1 + j:], (0, 1 + j))
        o = model.ttt_step(h, ids_j, pos + j, caches)
        out.append(model.logits(o))
        h = model.next_hidden(o)
    return out


def chain_logits(model: Eagle3Draft, aux: torch.Tensor, ids: torch.Tensor, t: int, steps: int) -> list[torch.Tensor]:
    """Decode like vLLM: step 0 over positions 0..t with the verifier features, then one token per step."""
    h = model.fuse(aux[:, : t + 1])
    logits, h_next, kv = model.forward_cached(h, ids[:, 1: t + 2], torch.arange(t + 1)[None], None)
    out = [logits[:, -1]]
    h = h_next[:, -1:]
    for j in range(1, steps):
        logits, h_next, kv = model.forward_cached(h, ids[:, t + 1 + j: t + 2 + j], torch.tensor([[t + j]]), kv)
        out.append(logits[:, -1])
        h = h_next
    return out


@pytest.mark.parametrize("options", [{}, {"norm_before_residual": True}, {"norm_output": True, "norm_before_fc": True},
                                     {"fc_norm": True}, {"num_layers": 2}])
# the merged kernel; masked: one SDPA call per step, blocks of 5 queries (the last ragged)
@pytest.mark.parametrize("merged,query_block", [(True, None), (False, None), (False, 5)])
def test_ttt_matches_chain_decoding(options, merged, query_block, monkeypatch):
    monkeypatch.setattr(TTTAttention, "ttt_merged", merged)
    monkeypatch.setattr(TTTAttention, "ttt_query_block", query_block)
    torch.manual_seed(0)
    model = Eagle3Draft(tiny_config(**options)).eval()
    L, steps = 12, 4
    aux = torch.randn(1, L, 3 * 64)
    ids = torch.randint(0, 200, (1, L))
    with torch.no_grad():
        ttt = ttt_logits(model, aux, ids, steps)
        for t in (0, 3, L - 2 - steps):
            chain = chain_logits(model, aux, ids, t, steps)
            for j in range(steps):
                torch.testing.assert_close(ttt[j][:, t], chain[j], rtol=1e-4, atol=1e-5)


def test_padding_does_not_change_valid_positions():
    torch.manual_seed(1)
    model = Eagle3Draft(tiny_config()).eval()
    a = (torch.randn(1, 9, 192), torch.randint(0, 200, (1, 9)))
    b = (torch.randn(1, 14, 192), torch.randint(0, 200, (1, 14)))
    aux = torch.zeros(2, 14, 192)
    ids = torch.zeros(2, 14, dtype=torch.long)
    aux[0, :9], ids[0, :9] = a[0][0], a[1][0]
    aux[1], ids[1] = b[0][0], b[1][0]
    with torch.no_grad():
        batched = ttt_logits(model, aux, ids, 3)
        alone = ttt_logits(model, *a, 3)
    for j in range(3):
        n = 9 - 2 - j  # positions whose inputs lie inside the unpadded sample
        torch.testing.assert_close(batched[j][0, :n], alone[j][0, :n], rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("options", [{}, {"architecture": "mla", "num_key_value_heads": 4, "head_dim": 24,
                                           "q_lora_rank": 32, "kv_lora_rank": 16, "qk_nope_head_dim": 16,
                                           "qk_rope_head_dim": 8, "v_head_dim": 16}])
def test_ttt_kernels_give_the_same_outputs_and_gradients(options, monkeypatch):
    """The merged kernel and the masked blocks compute one function: same logits, same weight gradients, on a
    right-padded batch, for the Llama (GQA) and MLA layers."""
    torch.manual_seed(2)
    model = Eagle3Draft(tiny_config(num_layers=2, **options))
    aux, ids = torch.randn(2, 23, 192), torch.randint(0, 200, (2, 23))
    aux[0, 15:], ids[0, 15:] = 0, 0
    results = []
    for merged, block in ((False, None), (False, 4), (False, 7), (True, None)):
        monkeypatch.setattr(TTTAttention, "ttt_merged", merged)
        monkeypatch.setattr(TTTAttention, "ttt_query_block", block)
        model.zero_grad()
        logits = ttt_logits(model, aux, ids, 5)
        sum((x * torch.linspace(-1, 1, x.shape[-1])).sum() for x in logits).backward()
        results.append(([x.detach() for x in logits], {n: p.grad.clone() for n, p in model.named_parameters()
                                                       if p.grad is not None}))
    for logits, grads in results[1:]:
        for a, b in zip(logits, results[0][0]):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
        assert grads.keys() == results[0][1].keys()
        for name, g in grads.items():
            torch.testing.assert_close(g, results[0][1][name], rtol=1e-4, atol=1e-5, msg=name)


def test_ttt_gradients_flow_to_all_trainable_weights():
    model = Eagle3Draft(tiny_config())
    logits = ttt_logits(model, torch.randn(2, 10, 192), torch.randint(0, 200, (2, 10)), 3)
    sum(x.sum() for x in logits).backward()
    for name, p in model.named_parameters():
        if p.requires_grad:
            assert p.grad is not None and p.grad.abs().sum() > 0, name
    assert model.embed_tokens.weight.grad is None


def test_config_validation_errors_are_clear():
    with pytest.raises(ValueError, match="aux_layer_ids"):
        tiny_config(aux_layer_ids=(1, 2))
    with pytest.raises(ValueError, match=r"\[3, 1, 2\] are not in increasing order"):
        tiny_config(aux_layer_ids=(3, 1, 2))
    with pytest.raises(ValueError, match=r"\[1, 1, 2\] have duplicates"):
        tiny_config(aux_layer_ids=(1, 1, 2))
    with pytest.raises(ValueError, match="mutually exclusive"):
        tiny_config(norm_before_fc=True, fc_norm=True)


LLAMA3_ROPE = {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 64}


@pytest.mark.parametrize("scaling", [{"type": "llama3", **LLAMA3_ROPE}, {"rope_type": "llama3", **LLAMA3_ROPE},
                                     {"type": "linear", "factor": 4.0}])
def test_exports_carry_the_verifiers_rope_type(scaling):
    """A legacy `rope_scaling: {"type": ...}` (transformers 4 configs) is exported as that rope type, not "default":
    transformers reads each exported layer config back to the RoPE the draft was trained with."""
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    from eagle3_train.checkpoints.layouts import eagle_config_json, speculators_config_json

    verifier = {"hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 96,
                "vocab_size": 200, "num_hidden_layers": 8, "rope_theta": 500000.0, "max_position_embeddings": 512,
                "rope_scaling": scaling}
    cfg = DraftConfig.from_verifier(verifier, 50)
    kind = scaling.get("rope_type") or scaling["type"]
    x, pos = torch.zeros(1, 1, cfg.head_dim), torch.tensor([[0, 7, 100, 500]])
    trained = Eagle3Draft(cfg).rotary(x, pos)
    default = LlamaRotaryEmbedding(LlamaConfig(hidden_size=64, num_attention_heads=4, head_dim=16,
                                               rope_parameters={"rope_type": "default", "rope_theta": 500000.0}))
    assert not torch.allclose(trained[0], default(x, pos)[0])  # the draft trains with the scaled RoPE
    for layer in (eagle_config_json(cfg, "float32"),
                  speculators_config_json(cfg, "float32", 3, "v")["transformer_layer_config"]):
        assert layer["rope_parameters"]["rope_type"] == kind
        assert layer["rope_scaling"]["rope_type"] == layer["rope_scaling"].get("type", kind) == kind
        served = LlamaRotaryEmbedding(LlamaConfig.from_dict(layer))(x, pos)
        assert torch.equal(served[0], trained[0]) and torch.equal(served[1], trained[1])


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_merged_kernel_is_the_masked_attention(dtype, tol):
    """The merged kernel against the masked reference at one TTT step: outputs and the gradients of queries, step-0
    keys/values and every diagonal key/value (GQA, 3 query heads per key head); bf16 within the rounding of both."""
    from eagle3_train.model.ttt_attention import check_merged, masked_ttt_attention, ttt_attention

    torch.manual_seed(3)
    B, L, d, j = 2, 37, 16, 4
    make = lambda h: torch.randn(B, h, L, d, dtype=dtype, requires_grad=True)  # noqa: E731
    q, k0, v0 = make(6), make(2), make(2)
    kd, vd = [make(2) for _ in range(j)], [make(2) for _ in range(j)]
    weight = torch.randn(B, 6, L, d)
    inputs = [q, k0, v0, *kd, *vd]
    got, want = (
        [out.detach(), *torch.autograd.grad((out.float() * weight).sum(), inputs)]
        for out in (ttt_attention(q, k0, v0, kd, vd, scale=0.3), masked_ttt_attention(q, k0, v0, kd, vd, 5, 0.3)))
    for name, a, b in zip(["out", "q", "k0", "v0"] + [f"k{i}" for i in range(j)] + [f"v{i}" for i in range(j)],
                          got, want):
        assert a.dtype == b.dtype
        err = ((a.float() - b.float()).abs().max() / b.float().abs().max()).item()
        assert err <= tol, (name, err)
    state = torch.get_rng_state()
    assert check_merged(torch.device("cpu"), dtype)
    assert torch.equal(state, torch.get_rng_state())  # the check draws from its own generator
