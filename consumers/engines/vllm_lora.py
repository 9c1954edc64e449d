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
import shutil
from pathlib import Path
from typing import Any

from consumers.engines.adapters import CONFIG_FILE, Adapter, adapter_failure, safetensors_header
from consumers.work import Failure

log = logging.getLogger(__name__)
ZERO_LORA_ID = 2**31 - 1  # the zero adapter's engine id: far from the adapter book's (1, 2, ...)
_DTYPES = {"F32": "float32", "F16": "float16", "BF16": "bfloat16", "F64": "float64"}


class VLLMLoras:
    """Which adapter versions this engine has loaded (or failed to load). Only the engine thread uses it."""

    def __init__(self, cpu: bool = False) -> None:
        self._loaded: dict[int, Any] = {}  # lora id -> its LoRARequest
        self._failed: dict[int, Failure] = {}
        # vLLM's CPU build (0.32) runs its LoRA kernels in torch (vllm/lora/ops/torch_ops/lora_ops.py), where a token
        # of no adapter has slot index -1: ``weights[-1]``, the LAST slot. Once every ``max_loras`` slot holds an
        # adapter, records of the base model get the last slot's adapter added. So on CPU, once any adapter is loaded,
        # base records run with a zero adapter (every B and A matrix zero: the base model's output exactly).
        self._cpu = cpu
        self._zero: Any = None

    def forget(self) -> None:
        """The engine was (re)started: nothing is loaded in it."""
        self._loaded.clear()
        self._failed.clear()
        self._zero = None

    def request(self, engine: Any, adapter: Adapter | None) -> Any:
        """The record's ``LoRARequest`` (None for the base model), loading its version first if needed; a
        :class:`Failure` naming ``adapter`` when vLLM cannot load it."""
        if adapter is None:
            return self._zero
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
        if self._cpu and self._zero is None:
            self._zero = self._zero_adapter(engine, adapter, LoRARequest)
        return lora

    def _zero_adapter(self, engine: Any, like: Adapter, request: Any) -> Any:
        """A LoRARequest of an adapter shaped like ``like`` whose weights are all zero (None if it cannot load)."""
        root = Path(like.path).parent.parent / ".zero"
        try:
            make_zero_adapter(Path(like.path), root)
            lora = request("batchline-base-model", ZERO_LORA_ID, str(root))
            engine.add_lora(lora)
        except Exception as exc:  # base records then run without one, as vLLM would
            log.warning("no zero adapter for base-model records on CPU (%s): they may get another adapter's", exc)
            return None
        return lora


def make_zero_adapter(like: Path, out: Path) -> Path:
    """An adapter in ``out`` with ``like``'s config and tensors (names, shapes, dtypes), every value zero."""
    import torch
    from safetensors.torch import save_file

    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    shutil.copy(like / CONFIG_FILE, out / CONFIG_FILE)
    for weights in like.glob("*.safetensors"):
        header = safetensors_header(weights)
        tensors = {
            name: torch.zeros(spec["shape"], dtype=getattr(torch, _DTYPES.get(spec["dtype"], "float32")))
            for name, spec in header.items()
        }
        save_file(tensors, str(out / weights.name))
    return out
