"""A conversation as the verifier's prompt ids (its chat template) and the token ids that end a reply: what offline
decoding of a turn starts from and stops at.

Python API: `render_prompt(tokenizer, messages) -> list[int]`, `stop_token_ids(tokenizer, model) -> set[int]`.
"""

from __future__ import annotations

from eagle3_train.data.chat_mask import end_of_turn_token_id
from eagle3_train.utils.io import Eagle3InputError


def render_prompt(tokenizer, messages: list[dict[str, str]]) -> list[int]:
    if not tokenizer.chat_template:
        raise Eagle3InputError("the verifier's tokenizer has no chat template; offline evaluation renders prompts "
                               "with it (add chat_template.jinja to the verifier directory)")
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return tokenizer(text, add_special_tokens=False)["input_ids"]  # the template already holds BOS etc.


def stop_token_ids(tokenizer, model) -> set[int]:
    """EOS ids of the tokenizer and generation config, plus the chat template's end-of-turn token."""
    stop: set[int] = set()
    for value in (tokenizer.eos_token_id, getattr(model.generation_config, "eos_token_id", None)):
        if isinstance(value, int):
            stop.add(value)
        elif value:
            stop.update(int(v) for v in value)
    if tokenizer.chat_template:
        eot = end_of_turn_token_id(tokenizer)
        if eot is not None:
            stop.add(eot)
    return stop
