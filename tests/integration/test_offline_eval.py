"""Offline evaluation: chain speculative decoding must reproduce greedy decoding, count acceptance exactly, and
recompute what a from-scratch draft run proposes; plus loading, held-out check, report and CLI."""

from __future__ import annotations

import json
import shutil
from collections import Counter
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from eagle3_train.checkpoints.native import load_draft, save_checkpoint
from eagle3_train.evaluate.decode import ThinkTags
from eagle3_train.evaluate.held_out import held_out_check
from eagle3_train.evaluate.offline import evaluate_offline
from eagle3_train.evaluate.prompts import EvalPrompt
from eagle3_train.evaluate.report import format_table
from eagle3_train.model.config import DraftConfig
from eagle3_train.model.draft import Eagle3Draft
from eagle3_train.utils.io import Eagle3InputError

PROMPTS = [
    EvalPrompt("p0", "chat", ["Tell me about the sea.", "Now make it shorter."]),
    EvalPrompt("p1", "code", ["Write a Python function that adds two numbers."]),
]


def make_draft(verifier_dir: Path, draft_vocab: int = 256, aux=(1, 2, 3), seed: int = 0,
               must_include: tuple[int, ...] = (), std: float = 0.02) -> Eagle3Draft:
    """A random draft (weights ~ N(0, std)) over a random, sorted draft vocabulary holding `must_include`."""
    cfg = DraftConfig.from_verifier(json.loads((verifier_dir / "config.json").read_text()), draft_vocab,
                                    aux_layer_ids=aux)
    g = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    draft = Eagle3Draft(cfg)
    draft.reset_parameters(std)
    V = cfg.vocab_size
    rest = [int(i) for i in torch.randperm(V, generator=g) if int(i) not in must_include]
    ids = torch.tensor(sorted(list(must_include) + rest[: draft_vocab - len(must_include)]))
    t2d = torch.zeros(V, dtype=torch.bool)
    t2d[ids] = True
    draft.set_vocab(ids - torch.arange(draft_vocab), t2d)
    return draft


def constant_draft(draft: Eagle3Draft, token: int) -> Eagle3Draft:
    """Rig a draft to always propose `token`: a zero lm_head makes every logit equal, so argmax picks draft row 0;
    swap rows so that row 0 maps to `token` (d2t stays a bijection onto the same draft vocabulary)."""
    targets = draft.draft_token_ids()
    r = int((targets == token).nonzero()[0])
    targets[[0, r]] = targets[[r, 0]]
    with torch.no_grad():
        draft.lm_head.weight.zero_()
        draft.d2t.copy_(targets - torch.arange(len(targets)))
    assert int(draft.draft_token_ids()[0]) == token
    return draft


def save_draft(path: Path, draft: Eagle3Draft, metadata: dict | None = None) -> Path:
    return save_checkpoint(path, draft, None, metadata or {"verifier": {}})


def prompt_ids(tokenizer, messages) -> list[int]:
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def hf_generate(model, ids: list[int], max_new: int, stop: list[int]) -> list[int]:
    """Greedy reference from transformers' own generate (independent of the evaluator's greedy loop)."""
    out = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                         max_new_tokens=max_new, do_sample=False, eos_token_id=stop, pad_token_id=stop[0])
    return out[0, len(ids):].tolist()


def turn_prompts(tokenizer, prompt: EvalPrompt, record: dict) -> list[list[int]]:
    """The token ids each turn was decoded from (turn 2 follows the model's own first answer)."""
    messages, out = [], []
    for turn, rec in zip(prompt.turns, record["turns"]):
        messages.append({"role": "user", "content": turn})
        out.append(prompt_ids(tokenizer, messages))
        messages.append({"role": "assistant", "content": rec["output"]})
    return out


def brute_force_rounds(turn: dict, reference: list[int], k: int) -> None:
    """Each round's accepted count = longest prefix of its proposal equal to the reference continuation."""
    assert turn["tokens"] == reference
    emitted = [reference[0]]  # the prefill's token
    for r in turn["rounds"]:
        s = r["start"]
        assert s == len(emitted)
        expect = 0
        while expect < k and s + expect < len(reference) and r["proposal"][expect] == reference[s + expect]:
            expect += 1
        assert r["accepted"] == expect
        assert r["emitted"] == reference[s: s + len(r["emitted"])]
        assert len(r["draft_margins"]) == k and all(m >= 0 for m in r["draft_margins"])
        emitted += r["emitted"]
    assert emitted == reference


def check_against_hf(result: dict, verifier_dir: Path, prompts: list[EvalPrompt], k: int, max_new: int) -> None:
    tokenizer = AutoTokenizer.from_pretrained(verifier_dir)
    model = AutoModelForCausalLM.from_pretrained(verifier_dir).eval()
    stop = result["stop_token_ids"]
    assert tokenizer.eos_token_id in stop
    drafts, per_pos = 0, [0] * k
    for prompt, rec in zip(prompts, result["prompts"]):
        for ids, turn in zip(turn_prompts(tokenizer, prompt, rec), rec["turns"]):
            brute_force_rounds(turn, hf_generate(model, ids, max_new, stop), k)
            drafts += len(turn["rounds"])
            for r in turn["rounds"]:
                for i in range(r["accepted"]):
                    per_pos[i] += 1
    overall = result["overall"]
    assert overall["num_drafts"] == drafts
    assert overall["num_accepted_tokens_per_pos"] == per_pos
    assert overall["mean_acceptance_length"] == pytest.approx(1 + sum(per_pos) / drafts)
    assert overall["per_position_acceptance"] == pytest.approx([a / drafts for a in per_pos])


@pytest.fixture(autouse=True)
def one_thread():
    """Tiny models decode token by token: thread hand-offs cost more than they save on a shared CPU."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def tiny(tiny_llama_dir) -> Path:
    return tiny_llama_dir()


def test_random_draft_output_equals_greedy(tiny, tmp_path):
    k, max_new = 3, 24
    ckpt = save_draft(tmp_path / "ckpt", make_draft(tiny))
    result = evaluate_offline(ckpt, tiny, PROMPTS, k=k, max_new_tokens=max_new, record_rounds=True)
    assert result["greedy_check"] == {"checked": True, "passed": True, "mismatches": []}
    assert all(t["greedy_identical"] for p in result["prompts"] for t in p["turns"])
    check_against_hf(result, tiny, PROMPTS, k, max_new)
    assert 1.0 <= result["overall"]["mean_acceptance_length"] <= k + 1
    assert set(result["benchmarks"]) == {"chat", "code"}
    assert result["benchmarks"]["chat"]["turns"] == 2
    assert result["held_out"] is None and not result["held_out_check"]["checked"]


def test_rigged_draft_acceptance_matches_brute_force(tiny, tmp_path):
    """A draft that always proposes the verifier's most frequent greedy token: partial acceptance, rejections and
    cache crops in most rounds, all counted against an independent greedy reference."""
    k, max_new = 3, 32
    tokenizer = AutoTokenizer.from_pretrained(tiny)
    model = AutoModelForCausalLM.from_pretrained(tiny).eval()
    prompts = [PROMPTS[1]]
    ref = hf_generate(model, prompt_ids(tokenizer, [{"role": "user", "content": prompts[0].turns[0]}]), max_new,
                      [tokenizer.eos_token_id])
    favourite = Counter(ref).most_common(1)[0][0]
    draft = constant_draft(make_draft(tiny, must_include=(favourite,)), favourite)
    ckpt = save_draft(tmp_path / "ckpt", draft)
    result = evaluate_offline(ckpt, tiny, prompts, k=k, max_new_tokens=max_new, record_rounds=True)
    rounds = result["prompts"][0]["turns"][0]["rounds"]
    assert all(r["proposal"] == [favourite] * k for r in rounds)
    check_against_hf(result, tiny, prompts, k, max_new)
    accepted = [r["accepted"] for r in rounds]
    assert sum(accepted) > 0 and min(accepted) < k  # both acceptances and rejections happened


def test_a_thinking_models_rounds_are_counted_inside_and_after_its_reasoning(tiny, tmp_path):
    """Rounds that start before the reasoning closes count as `reasoning`, the rest as `answer`: the prompt opens the
    reasoning (its last token plays `<think>`) and a token from the middle of the output plays `</think>`."""
    k, max_new = 3, 32
    tokenizer = AutoTokenizer.from_pretrained(tiny)
    model = AutoModelForCausalLM.from_pretrained(tiny).eval()
    prompts = [PROMPTS[1]]
    ids = prompt_ids(tokenizer, [{"role": "user", "content": prompts[0].turns[0]}])
    ref = hf_generate(model, ids, max_new, [tokenizer.eos_token_id])
    favourite = Counter(ref).most_common(1)[0][0]
    ckpt = save_draft(tmp_path / "ckpt", constant_draft(make_draft(tiny, must_include=(favourite,)), favourite))
    think = ThinkTags(start=ids[-1], end=ref[len(ref) // 2])
    result = evaluate_offline(ckpt, tiny, prompts, k=k, max_new_tokens=max_new, record_rounds=True, think=think)
    turn = result["prompts"][0]["turns"][0]
    expected: dict[str, list[int]] = {}
    for r in turn["rounds"]:
        inside = True  # the prompt ends with the opening tag
        for t in turn["tokens"][:r["start"]]:
            inside = True if t == think.start else False if t == think.end else inside
        region = "reasoning" if inside else "answer"
        tally = expected.setdefault(region, [0, 0])
        tally[0], tally[1] = tally[0] + 1, tally[1] + r["accepted"]
    by_region = result["overall"]["by_region"]
    assert {n: [s["num_drafts"], s["num_accepted_tokens"]] for n, s in by_region.items()} == expected
    assert set(expected) == {"reasoning", "answer"}  # both regions met
    assert sum(s["num_drafts"] for s in by_region.values()) == result["overall"]["num_drafts"]
    assert "by_region" not in evaluate_offline(ckpt, tiny, prompts, k=k, max_new_tokens=8)["overall"]  # no tags


@pytest.fixture(scope="module")
def constant_verifier(tiny, tmp_path_factory) -> Path:
    """The tiny verifier with its final norm zeroed: every logit is 0, so greedy always emits token 0."""
    out = tmp_path_factory.mktemp("constant-verifier")
    model = AutoModelForCausalLM.from_pretrained(tiny)
    with torch.no_grad():
        model.model.norm.weight.zero_()
    model.save_pretrained(out)
    for f in tiny.iterdir():
        if f.name.startswith(("tokenizer", "chat_template", "special_tokens")):
            shutil.copy2(f, out / f.name)
    return out


@pytest.mark.parametrize("k,rounds,extra", [(3, 5, 0), (2, 4, 0), (3, 5, 2)])
def test_perfect_draft_accepts_everything(constant_verifier, tmp_path, k, rounds, extra):
    """Draft and verifier both always choose token 0: every draft is accepted. The budget of 1 + rounds*(k+1) new
    tokens (+ `extra`) makes the last round emit only `extra` drafted tokens when extra > 0."""
    draft = constant_draft(make_draft(constant_verifier, must_include=(0,)), 0)
    max_new = 1 + rounds * (k + 1) + extra
    result = evaluate_offline(save_draft(tmp_path / "c", draft), constant_verifier, [PROMPTS[1]], k=k,
                              max_new_tokens=max_new)
    assert 0 not in result["stop_token_ids"]
    o = result["overall"]
    assert o["new_tokens"] == max_new
    drafts = rounds + (extra > 0)
    assert o["num_drafts"] == drafts
    assert o["num_accepted_tokens"] == rounds * k + extra
    assert o["mean_acceptance_length"] == pytest.approx(1 + (rounds * k + extra) / drafts)
    assert o["verifier_forwards"] == 1 + drafts
    if extra == 0:
        assert o["mean_acceptance_length"] == k + 1
        assert o["per_position_acceptance"] == [1.0] * k
        assert o["tokens_per_verifier_forward"] == k + 1
    assert result["greedy_check"]["passed"]


class OracleDraft(Eagle3Draft):
    """Proposes the verifier's own greedy continuation, read from `self.sequence` (prompt + greedy reference): every
    draft is accepted. Only its proposals are rigged; its cache runs the real draft layers."""

    sequence: list[int]

    def forward_cached(self, h, input_ids, position_ids, kv):
        logits, h, kv = super().forward_cached(h, input_ids, position_ids, kv)
        nxt = int(position_ids[0, -1]) + 2  # the token after the one this position predicts from
        row = int((self.draft_token_ids() == self.sequence[min(nxt, len(self.sequence) - 1)]).nonzero()[0])
        logits = torch.full_like(logits, -1e4)
        logits[0, -1, row] = 0.0
        return logits, h, kv


def transformers4_crop_cache(config):
    """A DynamicCache with transformers 4.x's `crop(max_length)`: max_length >= 0 is the length to keep, so
    crop(0) empties the cache (transformers 5 treats crop(0) as a no-op)."""
    from transformers import DynamicCache

    class Cache4(DynamicCache):
        def crop(self, max_length: int) -> None:
            if max_length < 0:
                max_length = self.get_seq_length() + max_length
            for layer in self.layers:
                layer.keys, layer.values = layer.keys[..., :max_length, :], layer.values[..., :max_length, :]

    return Cache4(config=config)


@pytest.mark.parametrize("cache", ["transformers", "transformers4-crop"])
def test_fully_accepted_rounds_keep_the_verifier_context(tiny_llama_dir, cache):
    """All k drafts accepted in every round, with a verifier whose output depends on its context: the verifier's
    cache must keep every verified token (no crop when nothing was rejected), else its output drifts from greedy."""
    from eagle3_train.evaluate.decode import TappedVerifier, chain_decode

    verifier_dir = tiny_llama_dir(initializer_range=0.5)
    k, max_new = 3, 25
    tokenizer = AutoTokenizer.from_pretrained(verifier_dir)
    model = AutoModelForCausalLM.from_pretrained(verifier_dir).eval()
    ids = prompt_ids(tokenizer, [{"role": "user", "content": PROMPTS[0].turns[0]}])
    stop = [tokenizer.eos_token_id]
    reference = hf_generate(model, ids, max_new, stop)
    assert len(set(reference)) > 3  # the verifier's output depends on its context
    draft = make_draft(verifier_dir, must_include=tuple(sorted(set(reference))))
    draft.__class__ = OracleDraft
    draft.sequence = ids + reference
    tapped = TappedVerifier(model, draft.config.aux_layer_ids)
    if cache != "transformers":
        tapped.new_cache = lambda: transformers4_crop_cache(model.config)
    out = chain_decode(tapped, draft.eval(), ids, k, max_new, set(stop), record_rounds=True)
    assert out.tokens == reference
    assert len(out.rounds) >= 5 and all(r["accepted"] == k for r in out.rounds[:-1])


def test_draft_proposals_match_a_from_scratch_draft_run(tiny, tmp_path):
    """Every round's proposal equals a cache-free recomputation: the draft over all verified positions with
    features from HF output_hidden_states (input of layer i), tokens shifted by one, then its own chain. This checks
    the aux taps, the alignment and the cache crops of the decoding loop."""
    k, max_new = 3, 20
    # Large weights make the proposals depend on every input (token, position, features), not on fc(aux) alone.
    ckpt = save_draft(tmp_path / "ckpt", make_draft(tiny, seed=3, std=0.5))
    result = evaluate_offline(ckpt, tiny, PROMPTS[:1], k=k, max_new_tokens=max_new, record_rounds=True,
                              check_greedy=False)
    tokenizer = AutoTokenizer.from_pretrained(tiny)
    model = AutoModelForCausalLM.from_pretrained(tiny).eval()
    draft = load_draft(ckpt, embed=model.get_input_embeddings().weight).eval()
    to_target = draft.draft_token_ids()
    aux_ids = draft.config.aux_layer_ids
    rec = result["prompts"][0]
    n_rounds = 0
    with torch.no_grad():
        for ids, turn in zip(turn_prompts(tokenizer, PROMPTS[0], rec), rec["turns"]):
            seq = ids + turn["tokens"]
            hs = model(torch.tensor([seq]), output_hidden_states=True).hidden_states
            aux = torch.cat([hs[i][0] for i in aux_ids], dim=-1)
            for r in turn["rounds"]:
                L = len(ids) + r["start"]  # verified tokens, the last one not yet seen by the verifier's cache
                logits, h, kv = draft.forward_cached(draft.fuse(aux[None, : L - 1]), torch.tensor([seq[1:L]]),
                                                     torch.arange(L - 1)[None], None)
                proposal = [int(to_target[logits[0, -1].argmax()])]
                h = h[:, -1:]
                for j in range(1, k):
                    logits, h, kv = draft.forward_cached(h, torch.tensor([[proposal[-1]]]),
                                                         torch.tensor([[L - 2 + j]]), kv)
                    proposal.append(int(to_target[logits[0, -1].argmax()]))
                assert proposal == r["proposal"], f"round starting at new token {r['start']}"
                n_rounds += 1
    assert n_rounds >= 10
    proposals = [tuple(r["proposal"]) for t in rec["turns"] for r in t["rounds"]]
    assert len(set(proposals)) > n_rounds // 2  # the draft reacts to its inputs


@pytest.mark.slow
def test_exported_drafts_decode_like_the_checkpoint(tiny_llama_dir, tmp_path):
    """EAGLE and speculators exports (float32) propose exactly what the checkpoint proposes; default taps come
    back from the export as the verifier's default layers."""
    from eagle3_train.export.exporter import export
    from eagle3_train.model.config import default_aux_layer_ids

    verifier = tiny_llama_dir(num_hidden_layers=8)
    draft = make_draft(verifier, aux=None, seed=5)
    assert draft.config.uses_default_aux_layers()
    ckpt = save_draft(tmp_path / "run" / "final", draft, {"verifier": {"path": str(verifier)}})
    kw = dict(k=2, max_new_tokens=12, record_rounds=True, check_greedy=False)
    base = evaluate_offline(tmp_path / "run", verifier, PROMPTS[1:], **kw)
    assert base["draft"]["path"] == str(ckpt)
    for fmt in ("eagle", "speculators"):
        out = tmp_path / fmt
        export(ckpt, out, fmt=fmt, dtype="float32", verifier=str(verifier))
        got = evaluate_offline(out, verifier, PROMPTS[1:], **kw)
        assert got["draft"]["format"] == ("speculators" if fmt == "speculators" else "eagle")
        assert got["draft"]["aux_layer_ids"] == list(default_aux_layer_ids(8))
        assert got["prompts"][0]["turns"][0]["rounds"] == base["prompts"][0]["turns"][0]["rounds"]


def test_vocab_mismatch_is_a_clear_error(tiny, tmp_path):
    cfg = DraftConfig(hidden_size=64, num_attention_heads=2, num_key_value_heads=2, head_dim=32,
                      intermediate_size=128, vocab_size=1000, draft_vocab_size=100, aux_layer_ids=(1, 2, 3))
    ckpt = save_draft(tmp_path / "small-vocab", Eagle3Draft(cfg))
    with pytest.raises(Eagle3InputError, match=r"vocab_size 1000 .*vocab_size 49152"):
        evaluate_offline(ckpt, tiny, PROMPTS[:1], max_new_tokens=4)


def test_bad_settings_and_missing_draft(tiny, tmp_path):
    with pytest.raises(Eagle3InputError, match="k .* must be >= 1"):
        evaluate_offline(tmp_path, tiny, PROMPTS, k=0)
    with pytest.raises(Eagle3InputError, match="draft not found"):
        evaluate_offline(tmp_path / "nope", tiny, PROMPTS)


def test_greedy_comparison_reports_position_and_logit_gap(tiny):
    from eagle3_train.evaluate.decode import TappedVerifier, compare_with_greedy, greedy_decode

    tokenizer = AutoTokenizer.from_pretrained(tiny)
    model = AutoModelForCausalLM.from_pretrained(tiny).eval()
    ids = prompt_ids(tokenizer, [{"role": "user", "content": "Hello"}])
    tapped = TappedVerifier(model, (1, 2, 3))
    ref = greedy_decode(tapped, ids, 6, {tokenizer.eos_token_id})
    assert compare_with_greedy(tapped, ids, list(ref.tokens), ref, 1e-3) is None
    other = 5 if ref.tokens[3] != 5 else 6
    spec = ref.tokens[:3] + [other] + ref.tokens[4:]
    with torch.no_grad():
        logits = model(torch.tensor([ids + ref.tokens[:3]])).logits[0, -1]
    diff = compare_with_greedy(tapped, ids, spec, ref, 1e-3)
    assert diff["position"] == 3 and diff["greedy_token"] == ref.tokens[3] and diff["spec_token"] == other
    assert diff["full_forward_logit_gap"] == pytest.approx(float(logits[ref.tokens[3]] - logits[other]), abs=1e-4)
    assert diff["full_forward_logit_gap"] > 0 and diff["near_tie"] is False
    assert compare_with_greedy(tapped, ids, spec, ref, tie_tol=1e9)["near_tie"] is True
    shorter = compare_with_greedy(tapped, ids, ref.tokens[:4], ref, 1e-3)
    assert shorter["position"] == 4 and shorter["near_tie"] is False


def test_served_mode_is_wired_to_the_served_evaluator():
    from eagle3_train.cli import build_parser

    argv = ["evaluate", "served", "--endpoint", "http://127.0.0.1:9/v1", "--prompts", "mt-bench", "--limit", "2"]
    args = build_parser(argv).parse_args(argv)
    assert args.eval_mode == "served" and args.endpoint == ["http://127.0.0.1:9/v1"] and args.num_prompts == 2


@pytest.fixture(scope="module")
def prepared(tiny, tmp_path_factory) -> Path:
    from eagle3_train.data.prepare import prepare

    root = tmp_path_factory.mktemp("prepared")
    convs = [
        {"id": "c0", "messages": [{"role": "user", "content": "Tell me   about the sea."},
                                  {"role": "assistant", "content": "It is wet."}]},
        {"id": "c1", "messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"},
                                  {"role": "user", "content": "Now make it shorter. Please."},
                                  {"role": "assistant", "content": "Ok."}]},
        {"id": "c2", "messages": [{"role": "user", "content": "Something else entirely"},
                                  {"role": "assistant", "content": "Sure."}]},
    ]
    src = root / "convs.jsonl"
    src.write_text("".join(json.dumps(c) + "\n" for c in convs))
    prepare(src, tiny, root / "out", val_fraction=0.0)
    return root / "out"


def test_held_out_check_matches_exact_user_turns(tiny, prepared):
    tokenizer = AutoTokenizer.from_pretrained(tiny)
    r = held_out_check(PROMPTS, prepared, tokenizer)
    assert r["checked"] and r["held_out"] is False
    # "Tell me about the sea." occurs (whitespace aside); "Now make it shorter." is only a prefix of a turn.
    assert r["prompts_in_train"] == ["p0"] and r["first_turns_in_train"] == ["p0"]
    assert r["overlaps"]["train"] == [{"prompt": "p0", "turn": 1, "conversation": "c0"}]
    assert r["user_turns_scanned"]["train"] == 4
    clean = held_out_check(PROMPTS[1:], prepared, tokenizer)
    assert clean["held_out"] is True and clean["overlaps"]["train"] == []


def test_held_out_is_read_from_the_draft_metadata(tiny, prepared, tmp_path):
    ckpt = save_draft(tmp_path / "ckpt", make_draft(tiny), {"data": {"prepared": str(prepared)}})
    result = evaluate_offline(ckpt, tiny, PROMPTS, k=2, max_new_tokens=3)
    assert result["held_out"] is False
    assert result["held_out_check"]["prompts_in_train"] == ["p0"]
    assert "held out: False" in format_table(result)


def test_cli_offline_writes_results_and_chart(tiny, tmp_path, capsys):
    from eagle3_train.cli import main

    ckpt = save_draft(tmp_path / "ckpt", make_draft(tiny), {"verifier": {"path": str(tiny)}})
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"id": "a", "turns": ["Say hi.", "Again."]}) + "\n"
                       + json.dumps({"id": "b", "prompt": "Count to three."}) + "\n"
                       + json.dumps({"id": "c", "prompt": "Not used."}) + "\n")
    out = tmp_path / "eval"
    rc = main(["evaluate", "offline", "--draft", str(ckpt), "--benchmark", str(prompts), "--num-prompts", "2",
               "-k", "2", "--max-new-tokens", "6", "--out", str(out)])
    assert rc == 0
    results = json.loads((out / "results.json").read_text())
    assert results["settings"]["verifier"] == str(tiny)  # read from the draft's metadata
    assert [p["id"] for p in results["prompts"]] == ["a", "b"]
    assert len(results["prompts"][0]["turns"]) == 2
    assert (out / "acceptance_by_position.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    table = capsys.readouterr().out
    assert "mean acc. len" in table and "acc@2" in table and "identical to greedy decoding" in table


def test_cli_needs_a_verifier_when_none_is_recorded(tmp_path, tiny, capsys):
    from eagle3_train.cli import main

    ckpt = save_draft(tmp_path / "ckpt", make_draft(tiny))
    assert main(["evaluate", "offline", "--draft", str(ckpt), "--max-new-tokens", "2"]) == 2
    assert "pass --verifier" in capsys.readouterr().err


def test_report_handles_served_results(tmp_path):
    from eagle3_train.evaluate.report import plot_acceptance

    served = {"mode": "served", "tokens_per_s": 12.5, "benchmarks": ["mini"],  # served: a list of names
              "acceptance": {"num_drafts": 10, "mean_acceptance_length": 2.1,
                             "per_position_acceptance": [0.6, 0.3, 0.2]}}
    table = format_table(served)
    assert "served" in table and "2.100" in table and "0.600" in table
    assert plot_acceptance(served, tmp_path / "c.png").read_bytes()[:4] == b"\x89PNG"


@pytest.mark.slow
def test_smollm2_random_draft_on_mtbench(smollm2_dir, tmp_path):
    from eagle3_train.evaluate.prompts import load_prompts

    prompts = load_prompts("mt-bench", limit=2)
    ckpt = save_draft(tmp_path / "ckpt", make_draft(smollm2_dir, draft_vocab=2048, aux=None))
    result = evaluate_offline(ckpt, smollm2_dir, prompts, k=3, max_new_tokens=16)
    assert result["greedy_check"]["passed"]
    assert result["overall"]["turns"] == 4
    assert result["overall"]["new_tokens"] <= 4 * 16
    assert result["draft"]["aux_layer_ids"] == [2, 15, 27]
    print("speed:", result["speed"], "overall:", result["overall"])
