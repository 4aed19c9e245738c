"""What the stages of one run share (`RunContext`), what one stage is (`Stage`: its key, output and runner), and the
small readers of the config the stages and the engine both need."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from eagle3_train.hidden_states.modes import StatesMode
from eagle3_train.hidden_states.modes import states_mode as mode_entry
from eagle3_train.utils.io import Eagle3InputError

if TYPE_CHECKING:
    from eagle3_train.assets.verifier import Verifier


def check_local_server(setting: str) -> None:
    """A run that starts its own hidden-state server needs the vLLM environment: say so before it starts."""
    from eagle3_train.serving.vllm_server import vllm_available

    ok, message = vllm_available()
    if not ok:
        raise Eagle3InputError(f"{setting} without endpoints, so the run would start a hidden-state server here, but "
                               f"{message}")


# --- the stages -----------------------------------------------------------------------------------------------------
class StageRefused(Eagle3InputError):
    """A stage's result cannot be used (generation skipped without generate.allow_fallback): it is forgotten, so the
    next run tries it again."""


class BadSetting(Eagle3InputError):
    """The config's own data (prepare.data) names no data or data that cannot be read: an error of the config, which
    the dry run reports as the run would, not data a stage has yet to write or fetch."""


@dataclass
class RunContext:
    """What the stages of one run share: the checked config, the verifier, and the keys and results so far."""
    cfg: dict[str, Any]
    run_dir: Path
    verifier: Verifier  # resolved once; .name is what the user gave
    verifier_dir: Path
    verifier_key: dict[str, Any]
    pipeline: Any  # the Pipeline running the stages (engine.py)
    data_source: str | list[str] = ""  # what prepare reads: the configured data (several: mixed), or generate's output
    # `run --dry-run`: keys are computed from what is on disk only; a dataset the data cache lacks is not fetched
    # (hub_datasets.NotFetched), and nothing is written
    dry_run: bool = False
    keys: dict[str, dict[str, Any]] = field(default_factory=dict)  # stage name -> the key it ran (or was kept) with
    summary: dict[str, Any] = field(default_factory=dict)

    @property
    def trust_remote_code(self) -> bool:  # not in the stage keys: it lets code run, it does not change outputs
        return bool(self.cfg["trust_remote_code"])

    def serving(self) -> dict[str, Any]:
        return self.cfg.get("serving") or {}


@dataclass(frozen=True)
class Stage:
    """One entry of the pipeline: the runner skips it when its key matches the recorded one, its output exists and
    every stage it reads finished before it; otherwise it runs `run` and records the key and result."""
    name: str  # its entry in pipeline_state.json (`NAME-VARIANT` for stages with variants)
    section: str  # the config section of its settings
    reads: tuple[str, ...]  # stages whose outputs it reads: one that ran later makes it run again
    writes: str  # its output under run_dir ({variant} filled in); missing = not done
    key: Callable[[RunContext, str | None], dict[str, Any]]  # what it depends on: settings and the keys it reads
    run: Callable[[RunContext, str | None], Any]  # does the work; the result is recorded (JSON)
    use: Callable[[RunContext, str | None, Any], None] = lambda ctx, variant, result: None  # result -> summary
    enabled: Callable[[RunContext], bool] = lambda ctx: True
    variants: Callable[[RunContext], list[str]] | None = None  # one entry per variant (export: per format)

    def instances(self, ctx: RunContext) -> list[tuple[str, str | None]]:
        """(state name, variant) of each instance this run has."""
        if self.variants is None:
            return [(self.name, None)]
        return [(f"{self.name}-{v}", v) for v in self.variants(ctx)]

    def output(self, ctx: RunContext, variant: str | None) -> Path:
        return ctx.run_dir / self.writes.format(variant=variant)

    def out_dir(self, ctx: RunContext, variant: str | None) -> Path:
        return ctx.run_dir / self.writes.format(variant=variant).split("/")[0]


def section(ctx: RunContext, name: str, *drop: str) -> dict[str, Any]:
    return {k: v for k, v in ctx.cfg[name].items() if k not in drop}


def with_serving(ctx: RunContext) -> dict[str, Any]:
    return {"serving": ctx.serving()} if ctx.serving() else {}


def aux_convention(ctx: RunContext) -> str:
    """train.source_aux_convention: how the finetune source's aux ids are meant (extract reads the source the same)."""
    return ctx.cfg["train"].get("source_aux_convention") or "auto"


def states_mode(ctx: RunContext) -> StatesMode:
    """offline: extract, then train from disk; online/hybrid: train asks hidden-state servers (no extract stage)."""
    return mode_entry(str(ctx.cfg["train"].get("hidden_states_mode") or "offline"))
