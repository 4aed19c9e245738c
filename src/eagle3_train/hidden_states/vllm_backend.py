"""`extract --backend vllm`: hidden states from vLLM servers (for verifiers that only a serving engine can run).

The servers run vLLM's `extract_hidden_states` method with our KV connector (start one with `eagle3-train serve
--extract-hidden-states`): for a prompt sent as token ids with `max_tokens: 1`, the server writes the captured layers
(the three aux ids and L, the last layer's output BEFORE the final norm) to a file and names it in the response's
`kv_transfer_params.hidden_states_path`. This client sends each sample's token ids (never text, so nothing is
re-tokenized; the echoed `prompt_token_ids` and the file's `token_ids` are checked against ours), to one or more
endpoints with bounded concurrency, reads the file (waiting on its `.lock`), deletes it, and returns the aux states
and the FINAL state as our format defines it (after the final norm): the verifier's final RMSNorm is applied here
with the weight read from the verifier checkpoint. The extract stage (`extract.py`) stores them in the same shards,
index and manifest as the HF backend, so training cannot tell them apart.

Client and server must see the same filesystem path (one machine, or a shared mount for `--hidden-states-dir`).

Of the verifier's weights this process needs only the final norm: `resolve_served_verifier` gives a directory with
the config, tokenizer, weight index and the ONE weight file holding that tensor (a hub id fetches just those, not the
~1 TB of a Kimi-K2), and `load_final_norm` reads that tensor alone.

Python API: `VLLMHiddenStates(endpoints, verifier_dir, layer_ids, store_dtype, ...)`: `.open() -> dict` (identity
for the manifest), `.run_batch(seqs) -> (aux [n, 3H], final [n, H])`, `.close()` (the producer interface,
`source.HiddenStateProducer`, as `hf_backend.HFHiddenStates`), and `.run_each(seqs)` for online training.
"""

from __future__ import annotations

import asyncio
import fcntl
import logging
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from eagle3_train.assets.families import text_config
from eagle3_train.model.verifier_head import _NORM_KEYS, load_final_norm
from eagle3_train.serving.client import (
    ChatPool,
    ContextTooLongError,
    EndpointUnavailable,
    FatalRequestError,
    RequestRejected,
    quiet_http_logs,
)
from eagle3_train.serving.metrics import root_url
from eagle3_train.settings import CONCURRENCY
from eagle3_train.utils.io import Eagle3InputError, read_json, read_weight_map

log = logging.getLogger(__name__)


WEIGHT_INDEX = "model.safetensors.index.json"
SERVE_HINT = "start one with `eagle3-train serve --extract-hidden-states --verifier NAME_OR_DIR [--layer-ids ...]`"


def final_norm_file(verifier_dir: str | Path) -> str:
    """The weight file (name inside the checkpoint) that holds the final norm: from the index's `weight_map`, else
    the single `model.safetensors`."""
    index = Path(verifier_dir) / WEIGHT_INDEX
    if not index.is_file():
        return "model.safetensors"
    weight_map = read_weight_map(index)
    found = next((weight_map[k] for k in _NORM_KEYS if k in weight_map), None)
    if not isinstance(found, str):
        raise Eagle3InputError(f"{index}: the weight_map names no final norm tensor (looked for "
                               f"{', '.join(_NORM_KEYS)})")
    return found


def resolve_served_verifier(verifier: str | Path) -> Path:
    """The verifier directory with what this client reads: config, tokenizer, weight index and the final norm's weight
    file. A hub id downloads those files only (the server loads the weights itself)."""
    from eagle3_train.assets.verifier import EMBEDDED, resolve_verifier

    path = resolve_verifier(verifier, need="tokenizer")  # local dirs and embedded names: as they are
    name = final_norm_file(path)
    if (path / name).is_file():
        return path
    if str(verifier) in EMBEDDED or Path(str(verifier)).expanduser().exists():
        raise Eagle3InputError(f"verifier {path} lacks {name}, the weight file that holds its final norm")
    from huggingface_hub import hf_hub_download

    try:  # into the same snapshot (its directory name is the commit)
        hf_hub_download(str(verifier), name, revision=path.name)
    except Exception as e:  # noqa: BLE001 - hub errors come in many types
        raise Eagle3InputError(f"could not download {name} (the final norm) of verifier '{verifier}' from the hub: "
                               f"{e}") from None
    return path


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """The verifier's final norm (Llama-style RMSNorm), computed in float32."""
    x = x.float()
    return weight.float() * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def served_file(path: str, allowed_dir: Path) -> Path:
    """The hidden-state file a server named, accepted only as a plain file directly under `allowed_dir` (the
    server's --hidden-states-dir as this client sees it): an endpoint's answer must never make the client open or
    delete anything else (no symlink, no `..`, no other directory)."""
    p = Path(path)
    root = allowed_dir.resolve()
    if not p.is_absolute() or ".." in p.parts or p.parent.resolve() != root or p.is_symlink() or \
            Path(path + ".lock").is_symlink():
        raise Eagle3InputError(f"the server named {path} as its hidden-state file, which is not a file directly in "
                               f"--hidden-states-dir {allowed_dir}: refusing to read or delete it (pass the "
                               f"directory the server writes to, as this machine sees it)")
    return root / p.name


def read_served(path: Path) -> dict[str, Any]:
    """Read a file the connector wrote (waiting for its writer's lock); `remove_served` deletes it once its
    contents proved it a hidden-state file of the request (a file that is not one is left in place)."""
    from safetensors import safe_open

    lock = Path(f"{path}.lock")
    try:
        with open(lock) as lf:
            fcntl.flock(lf, fcntl.LOCK_SH)  # sleeps until the server has written the file
    except FileNotFoundError:
        pass  # the connector may run without locks; the file is renamed into place when complete
    try:
        with safe_open(str(path), framework="pt") as f:
            out = {k: f.get_tensor(k) for k in f.keys()}
            out["metadata"] = f.metadata() or {}
    except FileNotFoundError:
        raise Eagle3InputError(
            f"the server named {path} as the hidden-state file but it does not exist here: the client must see the "
            f"server's --hidden-states-dir at the same path (same machine or a shared mount), and the server log may "
            f"show a failed write") from None
    except Exception as e:  # noqa: BLE001 - safetensors reports a malformed file as its own error type
        raise Eagle3InputError(f"cannot read the hidden-state file {path} the server named ({e}); it is left in "
                               f"place") from None
    return out


def remove_served(path: Path) -> None:
    for p in (path, Path(f"{path}.lock")):
        p.unlink(missing_ok=True)


class ServerUnavailable(Eagle3InputError):
    """No endpoint answered after the client's retries with backoff (or the server refuses this model): no other
    sample would fare better, so the run stops (and can be resumed) instead of skipping."""


class VLLMHiddenStates:
    """Aux and final hidden states of token sequences, computed by vLLM hidden-state servers (a
    `source.HiddenStateProducer`)."""

    stats = None  # no lm_head here: the verifier's full-vocab stats are left to training
    load_s = load_cpu_s = 0.0  # the servers load the verifier, not this process

    def __init__(self, endpoints: Sequence[str], verifier_dir: str | Path, layer_ids: Sequence[int],
                 store_dtype: torch.dtype, *, model: str | None = None, concurrency: int = CONCURRENCY,
                 timeout_s: float = 600.0, max_retries: int = 6, api_key: str = "EMPTY",
                 first_endpoint: int = 0, hidden_states_dir: str | Path | None = None) -> None:
        if not endpoints:
            raise Eagle3InputError(f"--backend vllm needs --endpoint URL (a hidden-state server; {SERVE_HINT})")
        if not hidden_states_dir or not Path(hidden_states_dir).is_dir():
            raise Eagle3InputError(f"hidden-state servers need --hidden-states-dir: the directory the server writes "
                                   f"each request's states to, as this machine sees it (got {hidden_states_dir!r}, "
                                   f"not an existing directory; {SERVE_HINT})")
        self.hidden_states_dir = Path(hidden_states_dir)
        if concurrency < 1:
            raise Eagle3InputError(f"concurrency must be >= 1, got {concurrency}")
        self.endpoints = [e.rstrip("/") for e in endpoints]
        self.verifier_dir = Path(verifier_dir)
        config = read_json(self.verifier_dir / "config.json", "verifier config")
        text = text_config(config)
        self.num_layers, self.hidden = int(text["num_hidden_layers"]), int(text["hidden_size"])
        # vLLM's DeepSeek-V2/V3 layers (Kimi's too) divide the residual stream by this in float16 (an overflow guard)
        self.fp16_residual_scale = float(text.get("routed_scaling_factor") or 1.0) if str(
            text.get("model_type", "")).startswith(("deepseek", "kimi")) else 1.0
        self.layer_ids = [int(i) for i in layer_ids]
        self.server_layer_ids = [*self.layer_ids, self.num_layers]  # what the server must capture, in this order
        self.store_dtype = store_dtype
        self.model = model
        self.concurrency = concurrency
        self.timeout_s, self.max_retries, self.api_key = timeout_s, max_retries, api_key
        self.first_endpoint = first_endpoint  # preferred at equal load (modulo the number of endpoints)
        self.norm_weight, self.norm_eps = load_final_norm(self.verifier_dir)
        self.loop: asyncio.AbstractEventLoop | None = None
        self.pool: ChatPool | None = None
        self.server_dtype: str | None = None
        # Summed over requests (they overlap): waiting on the server's answer, reading its file.
        self.timing = {"request_s": 0.0, "read_s": 0.0}

    # --- lifecycle -------------------------------------------------------------------------------------------
    def open(self) -> dict[str, Any]:
        """Connect, check every endpoint serves the model, and return the servers' identity for the manifest."""
        quiet_http_logs()
        self.loop = asyncio.new_event_loop()
        return self.loop.run_until_complete(self._open())

    async def _open(self) -> dict[str, Any]:
        self.pool = ChatPool(self.endpoints, self.model or "", timeout_s=self.timeout_s, max_retries=self.max_retries,
                             api_key=self.api_key, first=self.first_endpoint)
        try:
            if not self.model:
                self.pool.model = self.model = await self.pool.only_model()
            await self.pool.check_model()
            servers = [await self._server_info(ep) for ep in self.pool.endpoints]
        except (EndpointUnavailable, FatalRequestError) as e:
            raise Eagle3InputError(f"hidden-state server: {e} ({SERVE_HINT})") from None
        return {"endpoints": self.endpoints, "model": self.model, "servers": servers,
                "vllm_version": servers[0].get("version"), "server_layer_ids": self.server_layer_ids,
                "final": "the server's last layer (pre-norm) with the verifier's final RMSNorm applied by eagle3-train"}

    async def _server_info(self, ep: Any) -> dict[str, Any]:
        info: dict[str, Any] = {"url": ep.url}
        for m in await self.pool.model_cards(ep):
            if m["id"] == self.model:
                info.update(root=m["root"], max_model_len=m["max_model_len"])
        self._check_identity(ep.url, info.get("root"))
        info["version"] = await asyncio.to_thread(_server_version, root_url(ep.url))
        return info

    def _check_identity(self, url: str, root: str | None) -> None:
        """The server runs this run's verifier: the checkpoint it names (`root`) has the same config.json when it is
        a directory here (a base model served for an instruct run has the same shapes, and no other check sees it)."""
        if not root or not (Path(root) / "config.json").is_file():
            return  # a hub id, or a path on another machine: the shape checks of every reply remain
        if read_json(Path(root) / "config.json", "served verifier config") != read_json(
                self.verifier_dir / "config.json", "verifier config"):
            raise Eagle3InputError(f"{url} serves {root}, whose config.json differs from this run's verifier "
                                   f"{self.verifier_dir}: its hidden states are another model's; serve "
                                   f"{self.verifier_dir} or pass --verifier {root}")

    def close(self) -> None:
        if self.loop is not None:
            if self.pool is not None:
                self.loop.run_until_complete(self.pool.aclose())
            self.loop.close()
            self.loop, self.pool = None, None

    # --- work ------------------------------------------------------------------------------------------------
    def run_batch(self, seqs: Sequence[Sequence[int]]) -> tuple[torch.Tensor, torch.Tensor]:
        """(aux [n, 3H], final [n, H]) in the store dtype for the concatenated tokens of `seqs`, in order."""
        if self.loop is None:
            self.open()
        assert self.loop is not None
        parts = self.loop.run_until_complete(self._run_all(seqs))
        return torch.cat([a for a, _ in parts]), torch.cat([f for _, f in parts])

    def run_each(self, seqs: Sequence[Sequence[int]]) -> list[tuple[torch.Tensor, torch.Tensor] | Eagle3InputError]:
        """Like `run_batch`, one result per sequence, a failure returned in its place (the caller decides: a
        `ServerUnavailable` for every sample means the servers are down; otherwise those samples alone failed)."""
        if self.loop is None:
            self.open()
        assert self.loop is not None
        return self.loop.run_until_complete(self._run_all(seqs, keep_failures=True))

    async def _run_all(self, seqs: Sequence[Sequence[int]], keep_failures: bool = False) -> list[Any]:
        gate = asyncio.Semaphore(self.concurrency)

        async def one(seq: Sequence[int]) -> Any:
            async with gate:
                try:
                    return await self._one(list(seq))
                except Eagle3InputError as e:
                    if keep_failures:
                        return e
                    raise

        tasks = [asyncio.ensure_future(one(s)) for s in seqs]
        try:
            return list(await asyncio.gather(*tasks))
        except BaseException:
            for t in tasks:  # one failure stops the batch: no request is left running
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            raise

    async def _one(self, ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        assert self.pool is not None
        t0 = time.perf_counter()
        try:
            response, i = await self.pool.complete_tokens(ids, max_tokens=1, extra_body={"return_token_ids": True})
        except ContextTooLongError as e:
            raise Eagle3InputError(f"a sample of {len(ids)} tokens does not fit the server's context ({e}); start "
                                   f"the server with a larger --max-model-len (at least {len(ids) + 1})") from None
        except (FatalRequestError, EndpointUnavailable) as e:
            raise ServerUnavailable(f"hidden-state request failed: {e}") from None
        except RequestRejected as e:
            raise Eagle3InputError(f"hidden-state request failed: {e}") from None
        url = self.pool.endpoints[i].url
        path = (response.get("kv_transfer_params") or {}).get("hidden_states_path")
        if not path:
            raise Eagle3InputError(f"{url} returned no kv_transfer_params.hidden_states_path: it is not a "
                                   f"hidden-state server ({SERVE_HINT})")
        t1 = time.perf_counter()
        path = served_file(path, self.hidden_states_dir)
        data = await asyncio.to_thread(read_served, path)
        self.timing["request_s"] += t1 - t0
        self.timing["read_s"] += time.perf_counter() - t1
        echoed = (response.get("choices") or [{}])[0].get("prompt_token_ids")
        if echoed is not None and list(echoed) != ids:
            raise Eagle3InputError(f"{url} changed the prompt: it echoed {len(echoed)} token ids that differ from "
                                   f"the {len(ids)} sent (first difference at {_first_diff(echoed, ids)})")
        states = self._split(data, ids, url)  # refuses a file that is not this request's states: it stays
        remove_served(path)
        return states

    def _split(self, data: dict[str, Any], ids: list[int], url: str) -> tuple[torch.Tensor, torch.Tensor]:
        states, token_ids = data.get("hidden_states"), data.get("token_ids")
        if states is None or token_ids is None:
            raise Eagle3InputError(f"the hidden-state file from {url} lacks hidden_states/token_ids "
                                   f"(has {sorted(k for k in data if k != 'metadata')})")
        if token_ids.tolist() != ids:
            raise Eagle3InputError(f"{url} captured {token_ids.numel()} tokens that differ from the {len(ids)} sent")
        captured = data["metadata"].get("layer_ids")
        if captured is not None and captured != ",".join(map(str, self.server_layer_ids)):
            raise Eagle3InputError(f"{url} captures layers [{captured}] but this extraction needs "
                                   f"{self.server_layer_ids} (the aux ids and the last layer): restart the server "
                                   f"with --layer-ids {','.join(map(str, self.layer_ids))}, or extract with "
                                   f"--layer-ids matching the server")
        want = (len(ids), len(self.server_layer_ids), self.hidden)
        if tuple(states.shape) != want:
            raise Eagle3InputError(f"{url} returned hidden states of shape {list(states.shape)}, expected "
                                   f"{list(want)} ([tokens, aux layers + last, hidden size of {self.verifier_dir}]): "
                                   f"the server runs another verifier or other layer ids")
        self.server_dtype = self.server_dtype or str(states.dtype).removeprefix("torch.")
        if states.dtype == torch.float16 and self.fp16_residual_scale != 1.0:
            raise Eagle3InputError(f"{url} runs {self.verifier_dir.name} in float16, where vLLM's DeepSeek/Kimi layers "
                                   f"divide the residual stream by routed_scaling_factor "
                                   f"{self.fp16_residual_scale:g}: the captured states are off by that factor. "
                                   f"Serve it in bfloat16 (eagle3-train serve --server-dtype bfloat16)")
        aux = states[:, :-1].reshape(len(ids), -1).to(self.store_dtype)
        final = rms_norm(states[:, -1], self.norm_weight, self.norm_eps).to(self.store_dtype)
        return aux, final


def _server_version(root_url: str) -> str | None:
    """vLLM's version from GET /version (informative; None when the server has no such route)."""
    import json
    import urllib.request

    try:
        with urllib.request.urlopen(root_url + "/version", timeout=10) as r:
            return json.loads(r.read()).get("version")
    except Exception:  # noqa: BLE001 - informative only
        return None


def _first_diff(a: Sequence[int], b: Sequence[int]) -> int:
    return next((k for k, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
