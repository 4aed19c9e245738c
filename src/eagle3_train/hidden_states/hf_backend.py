"""`extract --backend hf` (the default): the verifier run in this process with transformers.

Only the base model runs (no full-vocab logits kept, no `output_hidden_states`): forward pre-hooks (`AuxCapture`,
`layers.py`) keep the unpadded rows of the tapped layer inputs, and the base model's output is the final-norm state
(`run_batch`: one right-padded forward). The verifier's full-vocabulary argmax and logsumexp per token come from
`model.verifier_head.full_vocab_stats` with the lm_head in the dtype the verifier computes in and its logit transform
(`.stats`, applied by extract to the final state as stored).

Python API: `HFHiddenStates(verifier_dir, layer_ids, store_dtype, text_config, device=..., compute_dtype=...,
trust_remote_code=...)`: `.open() -> dict` (loads the model; the manifest's `verifier_stats` record),
`.run_batch(seqs) -> (aux [n, 3H], final [n, H])`, `.stats`, `.close()`: the producer interface
(`source.HiddenStateProducer`) that `vllm_backend.VLLMHiddenStates` implements too. `plan_batches(lengths, budget)`:
padded batches of at most `token_budget` tokens (extract sends the vLLM servers the same batches).
`resolve_device(device)`, `torch_dtype(name)`.
"""

from __future__ import annotations

import logging
import time
import typing
from collections.abc import Sequence
from functools import partial
from pathlib import Path

from eagle3_train.assets.verifier import from_pretrained
from eagle3_train.hidden_states.layers import AuxCapture, decoder_parts
from eagle3_train.settings import Dtype
from eagle3_train.utils.io import Eagle3InputError

log = logging.getLogger(__name__)
_CPU_STATS_ROWS = 128  # rows of full-vocabulary logits per chunk on a CPU (see HFHiddenStates._stats_fn)

DTYPES = typing.get_args(Dtype)


def torch_dtype(name: str):
    import torch

    if name not in DTYPES:
        raise Eagle3InputError(f"dtype must be one of {', '.join(DTYPES)}, got {name!r}")
    return getattr(torch, name)


def resolve_device(device: str | None) -> str:
    import torch

    from eagle3_train.utils.distributed import check_device

    if device in (None, "", "auto"):
        return "cuda" if torch.cuda.is_available() else "cpu"
    check_device(device)
    return device


def run_batch(base, capture: AuxCapture, seqs: Sequence[Sequence[int]], pad_id: int, device: str, store_dtype):
    """One padded forward of the base model; returns (aux [n, 3H], final [n, H]) for the real tokens, on device."""
    import torch

    longest = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), longest), pad_id, dtype=torch.long)
    mask = torch.zeros((len(seqs), longest), dtype=torch.bool)
    for b, s in enumerate(seqs):
        ids[b, : len(s)] = torch.as_tensor(s, dtype=torch.long)
        mask[b, : len(s)] = True
    ids, mask = ids.to(device), mask.to(device)
    capture.mask = mask
    # Right padding: real tokens never attend to the pads after them and keep positions 0..n-1.
    out = base(input_ids=ids, attention_mask=mask.long(), use_cache=False)
    final = out.last_hidden_state[mask].to(store_dtype)
    return capture.take(), final


def plan_batches(lengths: Sequence[int], token_budget: int) -> list[tuple[int, int]]:
    """Cut consecutive samples into batches whose padded size (count * longest) stays <= token_budget.

    Returns (start, end) ranges into `lengths`; a sample longer than the budget gets a batch of its own.
    """
    batches: list[tuple[int, int]] = []
    start, longest = 0, 0
    for i, n in enumerate(lengths):
        new_longest = max(longest, n)
        if i > start and (i - start + 1) * new_longest > token_budget:
            batches.append((start, i))
            start, new_longest = i, n
        longest = new_longest
    if start < len(lengths):
        batches.append((start, len(lengths)))
    return batches


class HFHiddenStates:
    """The verifier's aux and final states computed here; the model loads in `open` (a finished resume loads none)."""

    def __init__(self, verifier_path: Path, layer_ids: Sequence[int], store_dtype, text_config, *, device: str,
                 compute_dtype: str, trust_remote_code: bool) -> None:
        self.verifier_path, self.ids, self.store_dtype = verifier_path, layer_ids, store_dtype
        self.text_config, self.device, self.compute_dtype = text_config, device, compute_dtype
        self.trust_remote_code = trust_remote_code
        self.capture: AuxCapture | None = None
        self.stats = None  # final [n, H] -> (full-vocab argmax [n], logsumexp [n]), once open
        self.load_s = self.load_cpu_s = 0.0  # wall and CPU seconds of loading the model (left out of throughput)
        self._run = None

    def open(self) -> dict:
        """Load the verifier and hook its tapped layers; returns the manifest's `verifier_stats` record."""
        from transformers import AutoModelForCausalLM

        log.info("loading verifier %s on %s (%s)", self.verifier_path, self.device, self.compute_dtype)
        t_load, cpu_load = time.perf_counter(), time.process_time()
        model = from_pretrained(AutoModelForCausalLM, self.verifier_path, self.trust_remote_code,
                                dtype=torch_dtype(self.compute_dtype))
        model = model.to(self.device).eval()
        base, layers = decoder_parts(model)
        self.stats, record = self._stats_fn(model)
        self.capture = AuxCapture(layers, self.ids, self.store_dtype)
        pad_id = getattr(self.text_config, "pad_token_id", None) or 0
        self.load_s = time.perf_counter() - t_load
        self.load_cpu_s = time.process_time() - cpu_load
        self._run = partial(run_batch, base, self.capture, pad_id=pad_id, device=self.device,
                            store_dtype=self.store_dtype)
        return record

    def run_batch(self, seqs: Sequence[Sequence[int]]):
        """(aux [n, 3H], final [n, H]) of the real tokens of `seqs`, on the device, in the store dtype."""
        return self._run(seqs)

    def _stats_fn(self, model):
        """The full-vocab stats function (the verifier's lm_head and logit transform) and its manifest record.

        The lm_head stays in the verifier's compute dtype: in bf16 its argmax is the one the verifier itself takes
        (a float32 head disagreed on near-ties), and that matmul is half the cost of a float32 one. On a CPU the
        logits are made 128 rows at a time, which keeps a chunk (25 MB at a 49K vocabulary) in cache: 2.2 s per
        8,192 tokens against 3.0 at 1,024 rows and 4.9 in float32 (benchmarks/LOG.md)."""
        from eagle3_train.model.verifier_head import full_vocab_stats, logit_transform

        head = model.get_output_embeddings()
        if head is None:
            raise Eagle3InputError(f"verifier {self.verifier_path}: its model class has no output embeddings "
                                   f"(lm_head) to compute the full-vocabulary stats with")
        weight = head.weight.detach()
        transform = logit_transform(self.verifier_path)
        if transform.bias is not None:
            transform.bias = transform.bias.to(weight.device)
        record = {"vocab_size": int(weight.shape[0]), "tensors": "verifier_argmax [N] int32, verifier_lse [N] "
                  "float32: argmax and logsumexp of the verifier's full-vocabulary logits of the stored final state",
                  "lm_head_dtype": str(weight.dtype).removeprefix("torch."), "transform": transform.describe()}
        rows = {"chunk": _CPU_STATS_ROWS} if weight.device.type == "cpu" else {}  # else full_vocab_stats' default
        return partial(full_vocab_stats, lm_head=weight, transform=transform, **rows), record

    def close(self) -> None:
        if self.capture is not None:
            self.capture.remove()
