"""A vLLM KV connector that writes the hidden states captured by vLLM's `extract_hidden_states` method to files,
on CPU as well as on GPU. Runs inside the vLLM server (imported by name via `kv_transfer_config.
kv_connector_module_path`); it must import nothing from eagle3_train.

On CUDA it is vLLM's `ExampleHiddenStatesConnector` unchanged (asynchronous device-to-host copy on a side stream into
pinned memory, written by a thread pool). That write path needs CUDA (pinned memory, streams, events), so where the
cache is not on a CUDA device the states are copied and written synchronously instead: the request's cache slots
are read, saved to a temporary file that is renamed into place, and the `.lock` file's exclusive lock (which
readers wait on) is released. The file holds `hidden_states` [T, n_layers, H] and `token_ids` [T] like the stock
connector's, plus the captured layer ids in the safetensors metadata (`layer_ids`), so a reader can check them.

Readers take a shared lock on `PATH.lock` before reading `PATH` and delete both files when done.
"""

from __future__ import annotations

import fcntl
import os
from typing import Any

import torch
from safetensors.torch import save_file
from vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector import (
    ExampleHiddenStatesConnector,
    extract_from_kv_cache,
)
from vllm.logger import init_logger

logger = init_logger(__name__)


class _AlreadyDone:
    """Stands in for the CUDA event the base class polls: a synchronous write has finished when it returns."""

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        pass


class Eagle3HiddenStatesConnector(ExampleHiddenStatesConnector):
    """`ExampleHiddenStatesConnector` with a synchronous write path where the cache is not on CUDA."""

    def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any = None) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        hf_config = vllm_config.speculative_config.draft_model_config.hf_config
        self.layer_ids = [int(i) for i in getattr(hf_config, "eagle_aux_hidden_state_layer_ids", [])]

    def _submit_async_write(self, pending: Any) -> None:
        if self._kv_cache is None or self._kv_cache.device.type == "cuda":
            super()._submit_async_write(pending)
            return
        if not self._is_tp_rank_zero:
            return
        num_tokens = int(pending.token_ids.shape[0])
        blocks = torch.as_tensor(pending.block_ids, dtype=torch.long)
        # Slot s of the request = position s of its prompt: block_ids[s // block_size] * block_size + s % block_size.
        slots = (blocks[:, None] * self._block_size + torch.arange(self._block_size)).flatten()
        states = extract_from_kv_cache(self._kv_cache, slots, num_tokens).clone()
        lock_fd = self._lock_fds.pop(pending.req_id, None)
        if lock_fd is None and self.use_lock:
            lock_fd = os.open(pending.filename + ".lock", os.O_CREAT | os.O_WRONLY | os.O_TRUNC, 0o644)
            fcntl.flock(lock_fd, fcntl.LOCK_EX)
        try:
            os.makedirs(os.path.dirname(pending.filename) or ".", exist_ok=True)
            tmp = f"{pending.filename}.{os.getpid()}.tmp"
            save_file({"hidden_states": states, "token_ids": pending.token_ids.clone()}, tmp,
                      metadata={"layer_ids": ",".join(map(str, self.layer_ids))})
            os.replace(tmp, pending.filename)  # readers never see a partial file, even without the lock
        except Exception as e:  # noqa: BLE001
            # A failed write (e.g. disk full) must not stop the engine: the reader finds no file and reports it.
            logger.error("writing hidden states to %s failed: %r", pending.filename, e)
        finally:
            if lock_fd is not None:
                os.close(lock_fd)  # releases the exclusive lock readers wait on
        self._req_copy_events[pending.req_id] = _AlreadyDone()  # reported as finished by the base get_finished
