"""The extract backends (`extract --backend hf|vllm`), one entry each: everything that differs between running the
verifier here and asking hidden-state servers, so the stage's loop (`extract.py`) and the pipeline never compare
backend names.

`BACKENDS[name]` / `backend_of(name)` (a clear Eagle3InputError for an unknown name) give a `Backend`:
- `runs_verifier_here`: HF loads the verifier in this process (a device, a compute dtype); vLLM needs servers;
- `stats_bytes`: disk bytes per token stored beyond the states (HF: the verifier's full-vocab stats);
- `record_key`: the manifest key of the producer's record (`verifier_stats` or `vllm`);
- `check_arguments`, `placement` (device, compute dtype), `open_verifier`, `producer` (a `HiddenStateProducer`
  factory, opened on first use).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any

from eagle3_train.assets.verifier import Need, Verifier, as_verifier, from_pretrained
from eagle3_train.hidden_states import store
from eagle3_train.utils.io import Eagle3InputError, read_json

if TYPE_CHECKING:
    from eagle3_train.hidden_states.source import HiddenStateProducer


@dataclass(frozen=True)
class Backend:
    name: str
    runs_verifier_here: bool  # False: the verifier runs in servers given as endpoints
    stats_bytes: int  # stored per token besides the states (utils.store_bytes.bytes_per_token)
    record_key: str  # the manifest key of what the producer's `open` returns
    verifier_need: Need  # what of the verifier this process fetches

    def check_arguments(self, processes: int, endpoints: Sequence[str], options: dict[str, Any]) -> None:
        """Refuse settings this backend cannot run with, before any output is touched."""

    def placement(self, device: str | None, compute_dtype: str | None, config: Any,
                  place: Callable[[str], str]) -> tuple[str, str | None]:
        """(device, compute dtype) the manifest records; `place` maps a device to this process's (torchrun)."""
        raise NotImplementedError

    def local_verifier(self, verifier: str | Path | Verifier) -> Verifier:
        """The verifier as this process reads it."""
        return as_verifier(verifier, self.verifier_need)

    def open_verifier(self, prepared_dir: Path, verifier: str | Path | Verifier | None,
                      trust_remote_code: bool) -> tuple[Verifier, Path, Any]:
        """(the Verifier, its local directory, its text config); None: the verifier the data was prepared with."""
        from transformers import AutoConfig

        from eagle3_train.data.prepare import check_prepared_tokenizer

        if verifier is None:  # the verifier that tokenized the data: another one would read other token ids
            recorded = read_json(prepared_dir / "manifest.json", "prepared-data manifest").get("verifier")
            verifier = Verifier.from_record(recorded, f"the prepared data {prepared_dir}", need=self.verifier_need)
        verifier = self.local_verifier(verifier)
        check_prepared_tokenizer(prepared_dir, verifier.path)
        config = from_pretrained(AutoConfig, verifier.path, trust_remote_code)
        return verifier, verifier.path, config.get_text_config() if hasattr(config, "get_text_config") else config

    def producer(self, verifier_path: Path, ids: Sequence[int], store_dtype: Any, text_config: Any, *, device: str,
                 compute_dtype: str | None, trust_remote_code: bool, endpoints: Sequence[str],
                 options: dict[str, Any]) -> Callable[[], HiddenStateProducer]:
        """A factory of the producer (called on first use: a finished resume loads nothing)."""
        raise NotImplementedError


@dataclass(frozen=True)
class HFBackend(Backend):
    """The verifier run here with transformers; stores the verifier's full-vocab stats too."""

    def placement(self, device: str | None, compute_dtype: str | None, config: Any,
                  place: Callable[[str], str]) -> tuple[str, str | None]:
        from eagle3_train.hidden_states.hf_backend import resolve_device, torch_dtype

        device = place(resolve_device(device))
        # auto/native/None: the teacher is the verifier as our vLLM server runs it here (the judge of the draft)
        from eagle3_train.serving.vllm_options import resolve_dtype

        compute_dtype = resolve_dtype("cpu" if device == "cpu" else "cuda", compute_dtype, config)
        torch_dtype(compute_dtype)  # a bad name fails before any output is touched
        return device, compute_dtype

    def producer(self, verifier_path: Path, ids: Sequence[int], store_dtype: Any, text_config: Any, *, device: str,
                 compute_dtype: str | None, trust_remote_code: bool, endpoints: Sequence[str],
                 options: dict[str, Any]) -> Callable[[], HiddenStateProducer]:
        from eagle3_train.hidden_states.hf_backend import HFHiddenStates

        return partial(HFHiddenStates, verifier_path, ids, store_dtype, text_config, device=device,
                       compute_dtype=compute_dtype, trust_remote_code=trust_remote_code)


@dataclass(frozen=True)
class VLLMBackend(Backend):
    """Hidden-state servers (`eagle3-train serve --extract-hidden-states`): here only the config, the tokenizer and
    the final norm; the servers decide where and in which dtype the verifier runs."""

    def check_arguments(self, processes: int, endpoints: Sequence[str], options: dict[str, Any]) -> None:
        if processes > 1:
            raise Eagle3InputError("--backend vllm runs in one process (the servers hold the verifier; several "
                                   "--endpoint share the work): run it without torchrun")
        if not endpoints:
            raise Eagle3InputError("--backend vllm needs --endpoint URL (a server started with "
                                   "`eagle3-train serve --extract-hidden-states`)")
        if not options.get("hidden_states_dir"):
            raise Eagle3InputError("--backend vllm needs --hidden-states-dir DIR: the directory the servers write "
                                   "each request's states to (`eagle3-train serve` prints it), as this machine sees it")

    def placement(self, device: str | None, compute_dtype: str | None, config: Any,
                  place: Callable[[str], str]) -> tuple[str, str | None]:
        return "vllm", None

    def local_verifier(self, verifier: str | Path | Verifier) -> Verifier:
        from eagle3_train.hidden_states.vllm_backend import resolve_served_verifier

        name = verifier.name if isinstance(verifier, Verifier) else str(verifier)
        path = resolve_served_verifier(name)
        return Verifier(name, path, read_json(path / "config.json", "verifier config"))

    def producer(self, verifier_path: Path, ids: Sequence[int], store_dtype: Any, text_config: Any, *, device: str,
                 compute_dtype: str | None, trust_remote_code: bool, endpoints: Sequence[str],
                 options: dict[str, Any]) -> Callable[[], HiddenStateProducer]:
        from eagle3_train.hidden_states.vllm_backend import VLLMHiddenStates

        return partial(VLLMHiddenStates, endpoints, verifier_path, ids, store_dtype, **options)


BACKENDS: dict[str, Backend] = {
    "hf": HFBackend("hf", runs_verifier_here=True, stats_bytes=store.STATS_BYTES, record_key="verifier_stats",
                    verifier_need="weights"),
    "vllm": VLLMBackend("vllm", runs_verifier_here=False, stats_bytes=0, record_key="vllm",
                        verifier_need="tokenizer"),
}


def backend_of(name: str) -> Backend:
    """The entry of backend `name`, or an Eagle3InputError naming the valid ones."""
    backend = BACKENDS.get(name) if isinstance(name, str) else None
    if backend is None:
        raise Eagle3InputError(f"backend must be one of {', '.join(BACKENDS)} (extract --backend), got {name!r}")
    return backend
