#!/usr/bin/env python3
"""speculators' offline hidden-state files from an eagle3-train hidden-state store, without running the verifier.

For every row i of the speculators dataset (the Arrow dir written by `speculators prepare-data`, read with
load_from_disk in the order its trainer reads it) this writes <out>/hs_{i}.safetensors in the layout of
gen_hidden_states.py:
  token_ids     int64 [T]         (the row's input_ids)
  hidden_states bf16  [T, 4, H]   (3 aux layers in increasing id order, then the final state)
speculators reads hidden_states[:, :-1].flatten(1) as the draft's fc input and hidden_states[:, -1] as
verifier_last_hidden_states, which its EAGLE-3 model uses only as verifier_lm_head(verifier_norm(.)) (the targets;
speculators 0.9.0 models/eagle3/core.py).

Rows are matched to the store's samples by token ids: the rows come from our prepared split (prepared_to_pretok.py),
and prepare-data keeps pre-tokenized rows as they are or cuts them to --seq-length (input_ids[:seq_length]). Each
sample of the prepared split that has stored states is hashed (blake2b of its int64 ids); a row is looked up by its
whole sequence, else as a prefix of a longer sample (a causal verifier's states of a prefix are the first T rows of the
full sequence's, so slicing is exact). Every row is matched before anything is written.

Layer mapping (identity for the aux states, checked, never shifted):
  our store id i (manifest `layer_ids`, always in the "input of decoder layer i" convention: extract converts a
  finetune source's SGLang ids before extracting, model/aux_layers.py) = the residual stream ENTERING decoder layer i
  = HF output_hidden_states[i] = what the HF backend's forward pre-hook on layers[i] keeps (hidden_states/layers.py)
  = vLLM's aux id i (eagle_aux_hidden_state_layer_ids) = gen_hidden_states.py's forward hook on layers[i-1] (the
  output of decoder layer i-1, which HF passes unchanged to layer i) = speculators' --target-layer-ids i.
  speculators' default ids are [2, L//2, L-3] (SmolLM2-135M: L=30 -> 2, 15, 27, the ids bench.sh passes); a store
  with other ids is refused (the draft would be trained on other layers than its config names).
  So hidden_states[:, j] = aux[:, j*H:(j+1)*H] for j = 0, 1, 2: the same tensors gen_hidden_states.py captures, up to
  the store's own rounding (its dtype, and the compute dtype extract ran the verifier in).

Final state (index 3): NOT the same residual point, so refused unless --final-from-normed.
  gen_hidden_states.py writes x = output of the LAST decoder layer, BEFORE the final norm (vLLM's id L).
  Our store's `final` is y = RMSNorm(x) = g * x / sqrt(mean(x^2) + eps), AFTER the final norm, for both extract
  backends (HF: the base model's last_hidden_state; vLLM: the client applies the norm; docs/ARCHITECTURE.md). x cannot
  be recovered from y: the per-token scale sqrt(mean(x^2) + eps) is gone. With --final-from-normed this writes
  z = y / g instead (g: the verifier's final-norm weight, read from its checkpoint; z = x / sqrt(mean(x^2) + eps), a
  positive per-token multiple of x). That is exact for what speculators' EAGLE-3 trainer computes from it, because
  RMSNorm ignores a per-token scale: verifier_norm(z) = g * z / sqrt(mean(z^2) + eps) = y / sqrt(m/(m+eps) + eps) with
  m = mean(x^2), i.e. y times a factor within ~eps (1e-5) of 1, so the targets lm_head(verifier_norm(z)) equal the
  ones from x up to bf16 rounding (z is rounded to bf16 once more, after y was stored). It is NOT the tensor
  gen_hidden_states.py writes (its magnitude is ~1 per element instead of x's), so it is wrong for any consumer that
  reads the last state without that norm (speculators' MTP uses it as the draft's input): hence opt-in. Refused as
  well: a verifier whose final norm is not a plain w * x / rms(x) (Gemma/Qwen3-Next's (1 + w), LayerNorm), a norm
  weight with zeros (those channels of z are lost and mean(z^2) would change), and fp8 stores (the states are then
  coarser than the bf16 files speculators expects).

Usage: states_from_store.py --store OUR_HIDDEN_STATES_DIR --split train --data SPECULATORS_PREPARE_DATA_DIR
       [--out DIR (default DATA/hidden_states)] [--final-from-normed] [--verifier DIR] [--prepared DIR]
"""
import argparse
import hashlib
import sys
import time
from pathlib import Path

import numpy as np
import torch
from datasets import load_from_disk
from safetensors.torch import save_file

from eagle3_train.assets.families import family_of
from eagle3_train.assets.verifier import recorded_name, resolve_verifier, same_verifier, verifier_identity
from eagle3_train.data.prepare import load_prepared
from eagle3_train.hidden_states.store import FORMAT_VERSION, HiddenStatesReader, check_hidden_states, read_manifest
from eagle3_train.model.verifier_head import load_final_norm
from eagle3_train.utils.io import Eagle3InputError, read_json


def fail(msg: str) -> None:
    print(f"states_from_store: error: {msg}", file=sys.stderr)
    sys.exit(2)


def digest(ids: np.ndarray) -> bytes:
    return hashlib.blake2b(np.ascontiguousarray(ids, dtype=np.int64).tobytes(), digest_size=16).digest()


def check_store(manifest: dict, args, final_from_normed: bool) -> list[int]:
    """The store's aux layer ids, after refusing a store whose states are not what speculators expects."""
    if manifest.get("format_version") != FORMAT_VERSION:
        fail(f"store format_version {manifest.get('format_version')!r}, this converter knows {FORMAT_VERSION} "
             f"(what 'final' means may differ)")
    L = int(manifest["num_layers"])
    ours = [int(i) for i in manifest["layer_ids"]]
    want = args.layer_ids or [2, L // 2, L - 3]
    if ours != want:
        fail(f"store layer ids {ours} (input of decoder layer i = speculators' id i) differ from the ids speculators "
             f"is told {want} (its default [2, L//2, L-3] for L={L}, or --layer-ids): extract with "
             f"--layer-ids {','.join(map(str, want))} or train speculators with --target-layer-ids "
             f"{' '.join(map(str, ours))}")
    if manifest.get("backend", "hf") not in ("hf", "vllm"):
        fail(f"store backend {manifest.get('backend')!r} is unknown to this converter")
    if manifest.get("dtype") == "float8_e4m3":
        fail("the store is fp8 (float8_e4m3): its states are coarser than the bf16 files speculators expects; "
             "extract with --store-dtype bfloat16 or float32")
    if not final_from_normed:
        fail("the store's 'final' is the verifier's state AFTER its final norm (both extract backends), while "
             "speculators' last slot is the last decoder layer's output BEFORE the norm; the pre-norm state cannot be "
             "recovered. --final-from-normed writes final / norm_weight instead, which gives speculators' EAGLE-3 "
             "targets (verifier_norm + lm_head) exactly but is not the pre-norm tensor (see this file's docstring)")
    return ours


def norm_multiplier(verifier_dir: Path, manifest: dict) -> torch.Tensor:
    config = read_json(verifier_dir / "config.json", "verifier config")
    if family_of(config).final_norm != "rms":
        fail(f"verifier {verifier_dir}: its final norm is {family_of(config).final_norm!r}, not w * x / rms(x); "
             f"un-norming the stored final state for speculators' verifier_norm is not supported for it")
    g, _eps = load_final_norm(verifier_dir)
    g = g.float()
    if g.shape != (int(manifest["hidden_size"]),):
        fail(f"verifier {verifier_dir}: final norm weight of shape {tuple(g.shape)}, store hidden size "
             f"{manifest['hidden_size']}")
    if bool((g == 0).any()):
        fail(f"verifier {verifier_dir}: its final norm weight has {int((g == 0).sum())} zero channels, so the "
             f"stored post-norm state cannot be un-normed")
    return g


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--store", required=True, help="our extract output dir (manifest.json, <split>/index.json)")
    ap.add_argument("--split", default="train")
    ap.add_argument("--data", required=True, help="speculators prepare-data output dir")
    ap.add_argument("--out", default=None, help="default: <data>/hidden_states")
    ap.add_argument("--prepared", default=None, help="our prepared dir (default: the one the store manifest names)")
    ap.add_argument("--verifier", default=None,
                    help="verifier dir, for its final-norm weight (default: the one the store manifest names)")
    ap.add_argument("--layer-ids", type=int, nargs=3, default=None,
                    help="the aux ids speculators trains with (default its [2, L//2, L-3])")
    ap.add_argument("--final-from-normed", action="store_true",
                    help="write final/norm_weight as the last slot (exact for speculators' EAGLE-3 targets only)")
    ap.add_argument("--every", type=float, default=10.0, help="seconds between progress lines")
    args = ap.parse_args()
    torch.set_num_threads(1)

    try:
        manifest = read_manifest(args.store)
        layer_ids = check_store(manifest, args, args.final_from_normed)
        prepared = Path(args.prepared or manifest["prepared_dir"])
        check_hidden_states(manifest, prepared, where=f"the hidden states in {args.store}")
        verifier_dir = resolve_verifier(args.verifier or recorded_name(manifest["verifier"]))
        if not same_verifier(verifier_identity(verifier_dir), manifest["verifier"]):
            fail(f"verifier {verifier_dir} is not the one the store was extracted with "
                 f"({manifest.get('verifier_name')})")
        g = norm_multiplier(verifier_dir, manifest)
        reader = HiddenStatesReader(args.store, args.split)
        ours = load_prepared(prepared, (args.split,), ("input_ids",))[0][args.split]
    except Eagle3InputError as e:
        fail(str(e))
    H = reader.hidden_size

    # our samples with states: full-sequence hashes, and the sequences for prefix lookups
    t0 = time.time()
    col = ours.data.column("input_ids")
    seqs: dict[int, np.ndarray] = {}
    full: dict[bytes, int] = {}
    for s in reader.sample_indices:
        ids = np.asarray(col[s].as_py(), dtype=np.int64)
        seqs[s] = ids
        full.setdefault(digest(ids), s)
    prefix_tables: dict[int, dict[bytes, int]] = {}

    def lookup(ids: np.ndarray) -> int | None:
        s = full.get(digest(ids))
        if s is None:  # prepare-data's --seq-length cut: a prefix of a longer sample
            T = len(ids)
            table = prefix_tables.get(T)
            if table is None:
                table = prefix_tables[T] = {}
                for k, v in seqs.items():
                    if len(v) > T:
                        table.setdefault(digest(v[:T]), k)
            s = table.get(digest(ids))
        if s is not None and not np.array_equal(seqs[s][:len(ids)], ids):
            return None  # a hash collision: treat as unmatched
        return s

    try:
        spec = load_from_disk(args.data)
    except (FileNotFoundError, ValueError) as e:
        fail(f"cannot read the speculators dataset {args.data}: {e}")
    rows = spec.data.column("input_ids")
    plan = []
    for i in range(len(spec)):
        ids = np.asarray(rows[i].as_py(), dtype=np.int64)
        if ids.size == 0:
            fail(f"speculators row {i} has no tokens")
        s = lookup(ids)
        if s is None:
            fail(f"speculators row {i} ({len(ids)} tokens, starts {ids[:8].tolist()}) matches no sample of split "
                 f"'{args.split}' with stored states in {args.store} (neither whole nor as a prefix)")
        plan.append((ids, s))
    n_prefix = sum(len(ids) < len(seqs[s]) for ids, s in plan)
    print(f"matched {len(plan)} rows to {len(set(s for _, s in plan))} stored samples ({n_prefix} as prefixes) in "
          f"{time.time() - t0:.1f}s; writing aux layers {layer_ids} + final / final-norm weight", flush=True)

    out = Path(args.out or Path(args.data) / "hidden_states")
    out.mkdir(parents=True, exist_ok=True)
    t0 = last = time.time()
    n_tok = 0
    for i, (ids, s) in enumerate(plan):
        T = len(ids)
        try:
            st = reader.load(s)
        except Eagle3InputError as e:
            fail(f"speculators row {i} (our sample {s}): {e}")
        aux = st["aux"][:T].float().view(T, 3, H)
        final = st["final"][:T].float() / g  # un-normed: see the docstring
        hs = torch.cat([aux, final.unsqueeze(1)], dim=1).to(torch.bfloat16).contiguous()  # [T, 4, H]
        save_file({"token_ids": torch.from_numpy(ids.copy()), "hidden_states": hs}, str(out / f"hs_{i}.safetensors"))
        n_tok += T
        now = time.time()
        if now - last >= args.every or i + 1 == len(plan):
            last = now
            dt = max(now - t0, 1e-9)
            print(f"[{i + 1}/{len(plan)}] tokens={n_tok} {n_tok / dt:.0f} tok/s {(i + 1) / dt:.1f} rows/s", flush=True)
    print(f"wrote {len(plan)} files, {n_tok} tokens to {out} in {time.time() - t0:.1f}s "
          f"(layer ids {layer_ids + [int(manifest['num_layers'])]}, store {args.store} split {args.split})", flush=True)


if __name__ == "__main__":
    main()
