"""Which verifier layers feed the draft (the three "aux" taps), in the "input of layer i" convention.

Layer id i means the residual stream ENTERING decoder layer i = HF `output_hidden_states[i]` (0 is the embedding
output). This is the convention of vLLM's `eagle_aux_hidden_state_layer_ids` and of the original EAGLE-3 code.
Id L (= num_layers) would be HF's last entry, which is AFTER the final norm: that is stored separately as `final`,
so it is not a valid aux tap. The draft config, extract, train and the servers all take the policy from here.
"""

from __future__ import annotations

from collections.abc import Sequence

from eagle3_train.utils.io import Eagle3InputError

NUM_AUX_LAYERS = 3  # vLLM/SGLang's EAGLE-3 fc layer takes exactly 3·H inputs


def default_layer_ids(num_layers: int, verifier: str = "the verifier") -> tuple[int, int, int]:
    """The taps extract and train use when none are given: (2, L//2, L-3) as in vLLM and EAGLE-3; tiny test models
    (L < 7, where those collide) get distinct low/mid/high taps instead. `verifier` names it in the error."""
    if num_layers < NUM_AUX_LAYERS:
        raise Eagle3InputError(f"{verifier} has {num_layers} decoder layers; EAGLE-3 needs at least "
                               f"{NUM_AUX_LAYERS} to tap distinct low/mid/high hidden states")
    ids = (2, num_layers // 2, num_layers - 3)
    if not ids[0] < ids[1] < ids[2]:
        ids = (1, num_layers // 2, num_layers - 1) if num_layers >= 4 else (0, 1, 2)
    return ids


def parse_layer_ids(text: str | Sequence[int] | None) -> tuple[int, ...] | None:
    """Parse '2,15,27' (CLI) or pass a sequence through; None stays None (= the default)."""
    if text is None:
        return None
    if isinstance(text, str):
        parts = [p.strip() for p in text.split(",") if p.strip()]
        try:
            return tuple(int(p) for p in parts)
        except ValueError:
            raise Eagle3InputError(f"--layer-ids must be comma-separated integers like '2,15,27', got {text!r}"
                                   ) from None
    return tuple(int(i) for i in text)


def validate_layer_ids(layer_ids: Sequence[int] | None, num_layers: int,
                       verifier: str = "the verifier", first: int = 0) -> tuple[int, int, int]:
    """Return the layer ids to tap (the default when None), or raise Eagle3InputError with what is allowed;
    `first`: the lowest id the verifier's family can serve (`Family.first_aux_layer`)."""
    if layer_ids is None:
        return default_layer_ids(num_layers, verifier)
    ids = tuple(int(i) for i in layer_ids)
    if len(ids) != NUM_AUX_LAYERS:
        raise Eagle3InputError(f"layer ids: expected exactly {NUM_AUX_LAYERS} ids (low, mid, high), got {list(ids)}")
    for i in ids:
        if i == num_layers:
            raise Eagle3InputError(
                f"layer id {i} is the final-norm output of this {num_layers}-layer verifier (stored separately as "
                f"'final'); aux layer ids must be in 0..{num_layers - 1} (id i = the input of decoder layer i)")
        if 0 <= i < first:
            raise Eagle3InputError(f"layer id {i} of {verifier}: vLLM cannot tap the input of its layer {i} (its "
                                   f"DeepSeek-V3/Kimi model has no residual stream before layer {first}), so a draft "
                                   f"on it could never be served; aux layer ids must be in {first}..{num_layers - 1}")
        if not 0 <= i < num_layers:
            raise Eagle3InputError(f"layer id {i} is out of range for a verifier with {num_layers} decoder layers: "
                                   f"ids must be in 0..{num_layers - 1} (id i = the input of decoder layer i)")
    return check_layer_order(ids, "--layer-ids")  # type: ignore[return-value]


def check_layer_order(layer_ids: Sequence[int], where: str, hint: str = "") -> tuple[int, ...]:
    """Return the ids unchanged if strictly increasing, else raise Eagle3InputError naming `where`.

    vLLM and SGLang collect the aux hidden states while walking the verifier's layers, i.e. concatenated in layer
    order whatever order the config lists; a draft trained on another column order is served scrambled (near-zero
    acceptance, no error). Duplicates give the engines fewer than 3 taps.
    """
    ids = tuple(int(i) for i in layer_ids)
    if all(a < b for a, b in zip(ids, ids[1:])):
        return ids
    fixed = sorted(set(ids))
    problem = "have duplicates" if len(fixed) != len(ids) else "are not in increasing order"
    raise Eagle3InputError(
        f"{where}: aux layer ids {list(ids)} {problem}; they must be {NUM_AUX_LAYERS} distinct ids in increasing "
        f"order (e.g. {','.join(map(str, fixed))}) because vLLM and SGLang concatenate the taps in layer order"
        + (f". {hint}" if hint else ""))
