"""Whether what `prepare` supervises is what the verifier generated: each regenerated assistant turn carries the token
ids vLLM returned (`completion_token_ids`, written by `generate`); the prepared sample's supervised run of that turn
must hold the same ids.

They differ where re-rendering the text does not give back the generated tokens: a reasoning parser that strips
whitespace before `</think>`, a template that renders the reasoning its own way, a model that produced a
non-canonical tokenisation of its own text. Those tokens would be trained as if the verifier had produced them, so
the mismatches are counted (and the first few named) in the prepared manifest.

Python API: `GeneratedIdsCheck().add(conv_id, messages, input_ids, loss_mask, cut)`; `.record()` for the manifest.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from eagle3_train.assets.conversation_records import TOKEN_IDS
from eagle3_train.data.chat_mask import UNSUPERVISED, supervised_runs

_EXAMPLES = 5
_END_TOKENS = 2  # the most tokens a template's end-of-turn marker takes (one special token, a newline)


@dataclass
class GeneratedIdsCheck:
    turns: int = 0  # regenerated turns compared
    equal: int = 0
    mismatched: int = 0
    cut: int = 0  # turns whose run the max length cut: compared on what was kept
    # the run is the generated ids plus the template's end of turn (a reply cut at max_tokens ends without one)
    end_added: int = 0
    not_compared: int = 0  # the sample's runs do not pair with its supervised turns (a turn cut away entirely)
    examples: list[dict[str, Any]] = field(default_factory=list)

    def add(self, conv_id: str, messages: list[dict[str, Any]], input_ids: list[int], loss_mask: list[int],
            cut: bool) -> None:
        """Compare one prepared sample's supervised runs with its turns' generated ids (turns without ids: skipped)."""
        supervised = [m for m in messages if m["role"] == "assistant" and not m.get(UNSUPERVISED)]
        if not any(TOKEN_IDS in m for m in supervised):
            return
        runs = supervised_runs(input_ids, loss_mask)
        if len(runs) != len(supervised) and not (cut and len(runs) < len(supervised)):
            self.not_compared += sum(TOKEN_IDS in m for m in supervised)
            return
        for k, (m, run) in enumerate(zip(supervised, runs)):
            generated = m.get(TOKEN_IDS)
            if generated is None:
                continue
            self.turns += 1
            last_kept = cut and k == len(runs) - 1
            same = run == generated[:len(run)] if last_kept else run == generated
            self.cut += last_kept
            if same:
                self.equal += 1
                continue
            if not last_kept and 0 < len(run) - len(generated) <= _END_TOKENS and run[:len(generated)] == generated:
                self.end_added += 1
                continue
            self.mismatched += 1
            if len(self.examples) < _EXAMPLES:
                at = next((i for i, (a, b) in enumerate(zip(run, generated)) if a != b), min(len(run), len(generated)))
                self.examples.append({"id": conv_id, "turn": k, "first_difference": at,
                                      "supervised": run[max(0, at - 3):at + 5],
                                      "generated": generated[max(0, at - 3):at + 5],
                                      "lengths": [len(run), len(generated)]})

    def record(self) -> dict[str, Any] | None:
        if not (self.turns or self.not_compared):
            return None
        return {"turns": self.turns, "equal": self.equal, "end_added": self.end_added,
                "mismatched": self.mismatched, "cut": self.cut,
                "not_compared": self.not_compared, "examples": self.examples}
