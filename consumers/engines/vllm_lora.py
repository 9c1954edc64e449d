"""The vLLM engine's LoRA adapters: a record's adapter as vLLM's ``LoRARequest``, loaded into the engine once.

Each adapter version is loaded with ``LLMEngine.add_lora`` the first time a record needs it, before the record joins
the running batch: a version vLLM cannot load (its weights unreadable, a layer it cannot serve) fails that record
alone, and every later record of that version at once, instead of failing a scheduler step that holds other records.
Records of any adapters (and of the base model) share vLLM's running batch; vLLM swaps adapters in and out of its
``max_loras`` slots itself (``max_cpu_loras`` kept in CPU memory), reloading an evicted one from the path it was
given: the worker's store copy of that version (:mod:`consumers.engines.adapters`), which never changes.
"""

from __future__ import annotations

import logging
from typing import Any

from consumers.engines.adapters import Adapter, adapter_failure
from consumers.work import Failure

log = logging.getLogger(__name__)


class VLLMLoras:
    """Which adapter versions this engine has loaded (or failed to load). Only the engine thread uses it."""

    def __init__(self) -> None:
        self._loaded: dict[int, Any] = {}  # lora id -> its LoRARequest
        self._failed: dict[int, Failure] = {}

    def forget(self) -> None:
        """The engine was (re)started: nothing is loaded in it."""
        self._loaded.clear()
        self._failed.clear()

    def request(self, engine: Any, adapter: Adapter | None) -> Any:
        """The record's ``LoRARequest`` (None for the base model), loading its version first if needed; a
        :class:`Failure` naming ``adapter`` when vLLM cannot load it."""
        if adapter is None:
            return None
        loaded = self._loaded.get(adapter.lora_id)
        if loaded is not None:
            return loaded
        failed = self._failed.get(adapter.lora_id)
        if failed is not None:
            return failed
        from vllm.lora.request import LoRARequest

        # vLLM compares LoRARequests by name: the digest in it keeps two versions of one adapter apart.
        lora = LoRARequest(f"{adapter.name}@{adapter.digest}", adapter.lora_id, adapter.path)
        try:
            engine.add_lora(lora)
        except Exception as exc:  # vLLM raises a bare Exception naming the worker's error
            failure = adapter_failure("AdapterLoadFailed", adapter.name, f"vLLM could not load it: {exc}")
            log.warning("adapter %s version %s: %s", adapter.name, adapter.digest, failure.message)
            self._failed[adapter.lora_id] = failure
            return failure
        self._loaded[adapter.lora_id] = lora
        return lora
