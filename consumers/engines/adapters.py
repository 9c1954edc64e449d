"""LoRA adapters of the job's model: which exist, what each version's digest is, and a frozen copy of each version.

The job names adapters (``engine.lora.adapters``: name -> PEFT directory) and/or a directory whose subdirectories are
adapters (``engine.lora.directory``), read again when a record names an adapter not known yet, so adding one needs no
restart. :meth:`AdapterBook.resolve` gives a record's adapter: its current version, or an ``invalid_input``
:class:`~consumers.work.Failure` whose message starts with the field (``adapter: ...``): unknown, unreadable, a rank
over ``max_lora_rank``, or made for another base model (its tensors' shapes against the base model's).

A version is identified by its digest: sha256 over ``adapter_config.json`` and the weight files. It is computed when
the version is first loaded, on a copy of the files in the worker's store (``<store>/<name>/<digest>/``): the engine
loads that copy, so what it runs is exactly what the digest names, and a run pinned to a version keeps it
(:meth:`AdapterBook.version`) after the source directory has changed. The source is looked at again (a few stat
calls) at most every ``engine.lora.rescan_s`` per name.

Thread-safety: the worker's thread resolves (intake, pinning); the engine thread only reads the :class:`Adapter`
values it is handed. A lock guards the book all the same.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import logging
import re
import shutil
import struct
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from batchline.config import JobConfig, LoraConfig
from consumers.work import Failure
from schemas.fast import ADAPTER_NAME_PATTERN

log = logging.getLogger(__name__)
CONFIG_FILE = "adapter_config.json"
WEIGHT_SUFFIXES = (".safetensors", ".bin")
VLLM_DEFAULT_MAX_LORA_RANK = 16  # vLLM's default ``max_lora_rank``
_NAME = re.compile(ADAPTER_NAME_PATTERN)
_PEFT_PREFIX = "base_model.model."


@dataclass(frozen=True, slots=True)
class Adapter:
    """One version of one adapter: its name, digest, the store copy the engine loads, and its engine id (unique per
    version within the process: vLLM keys loaded adapters by it)."""

    name: str
    digest: str
    path: str
    lora_id: int
    rank: int

    @property
    def lineage(self) -> tuple[str, str]:
        return (self.name, self.digest)


def adapter_failure(error_type: str, name: str, why: str) -> Failure:
    """A record's ``invalid_input`` failure about its adapter, naming the field."""
    return Failure("invalid_input", error_type, f"adapter: {name!r}: {why}"[:500])


class AdapterBook:
    def __init__(self, lora: LoraConfig, max_rank: int, base_model: str | None) -> None:
        self.lora = lora
        self.max_rank = max_rank
        self._base_shapes = _model_shapes(Path(base_model)) if base_model and Path(base_model).is_dir() else None
        self._own_store = lora.store is None
        self.store = Path(lora.store) if lora.store else Path(tempfile.mkdtemp(prefix="batchline-adapters-"))
        self.store.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()
        self._ids = itertools.count(1)
        self._sources: dict[str, Path] = {}
        self._scanned_at = -1e9
        self._current: dict[str, tuple[tuple[Any, ...], Adapter | Failure]] = {}  # name -> (files' stat, version)
        self._checked_at: dict[str, float] = {}
        self._versions: dict[tuple[str, str], Adapter] = {}
        self._rescan(force=True)
        self._load_store()

    @classmethod
    def for_job(cls, config: JobConfig) -> AdapterBook | None:
        eng = config.engine
        if not eng.lora.enabled:
            return None
        max_rank = int(eng.engine_kwargs.get("max_lora_rank", VLLM_DEFAULT_MAX_LORA_RANK))
        return cls(eng.lora, max_rank, eng.model if eng.name == "vllm" else None)

    def close(self) -> None:
        if self._own_store:
            shutil.rmtree(self.store, ignore_errors=True)

    def names(self) -> list[str]:
        with self._lock:
            self._rescan()
            return sorted(self._sources)

    def resolve(self, name: str) -> Adapter | Failure:
        """The adapter's current version (loaded into the store at first use), or why the record cannot have it."""
        with self._lock:
            if name not in self._sources:
                self._rescan()
            source = self._sources.get(name)
            if source is None:
                known = ", ".join(sorted(self._sources)[:20]) or "none"
                return adapter_failure("UnknownAdapter", name, f"no such adapter in this job (known: {known})")
            now = time.monotonic()
            held = self._current.get(name)
            if held is not None and now - self._checked_at.get(name, -1e9) < self.lora.rescan_s:
                return held[1]
            self._checked_at[name] = now
            stat = _stat(source)
            if held is not None and held[0] == stat:
                return held[1]
            version = self._load(name, source)
            self._current[name] = (stat, version)
            return version

    def version(self, name: str, digest: str) -> Adapter | None:
        """A version this worker holds (loaded now or before, or found in a persistent store), else None."""
        with self._lock:
            return self._versions.get((name, digest))

    # -- sources ---------------------------------------------------------------------------------
    def _rescan(self, force: bool = False) -> None:
        now = time.monotonic()
        if not force and now - self._scanned_at < self.lora.rescan_s:
            return
        self._scanned_at = now
        sources: dict[str, Path] = {}
        if self.lora.directory:
            root = Path(self.lora.directory)
            if root.is_dir():
                for sub in sorted(root.iterdir()):
                    if sub.is_dir() and _NAME.match(sub.name):
                        sources[sub.name] = sub
        sources.update({name: Path(path) for name, path in self.lora.adapters.items()})
        self._sources = sources

    def _load_store(self) -> None:
        """Versions a persistent store kept from earlier runs of this worker: a pinned run may still need them."""
        if self._own_store or not self.store.is_dir():
            return
        for kept in self.store.glob("*/*"):
            if kept.is_dir() and not kept.name.startswith("."):
                checked = self._check(kept.parent.name, kept)
                if isinstance(checked, int):
                    self._versions[(kept.parent.name, kept.name)] = Adapter(
                        kept.parent.name, kept.name, str(kept), next(self._ids), checked
                    )

    def _load(self, name: str, source: Path) -> Adapter | Failure:
        """Copy the source's files into the store, digest the copy, check it; the version or why it cannot load."""
        if not (source / CONFIG_FILE).is_file():
            return adapter_failure("AdapterLoadFailed", name, f"{source} has no {CONFIG_FILE}")
        staging = Path(tempfile.mkdtemp(prefix=".incoming-", dir=self.store))
        try:
            for f in _files(source):
                shutil.copy2(f, staging / f.name)
            digest = _digest(staging)
            kept = self._versions.get((name, digest))
            if kept is not None:
                return kept
            checked = self._check(name, staging)
            if isinstance(checked, Failure):
                return checked
            final = self.store / name / digest
            final.parent.mkdir(parents=True, exist_ok=True)
            if final.exists():
                shutil.rmtree(staging)
            else:
                staging.rename(final)
        except OSError as exc:
            return adapter_failure("AdapterLoadFailed", name, f"cannot read {source}: {exc}")
        finally:
            if staging.exists():
                shutil.rmtree(staging, ignore_errors=True)
        adapter = Adapter(name, digest, str(final), next(self._ids), checked)
        self._versions[(name, digest)] = adapter
        log.info("adapter %s version %s loaded from %s (rank %d)", name, digest, source, checked)
        return adapter

    def _check(self, name: str, root: Path) -> int | Failure:
        """The adapter's rank if the engine can serve it, else why not."""
        try:
            config = json.loads((root / CONFIG_FILE).read_text())
        except (OSError, ValueError) as exc:
            return adapter_failure("AdapterLoadFailed", name, f"unreadable {CONFIG_FILE}: {exc}")
        if not isinstance(config, dict) or str(config.get("peft_type", "LORA")).upper() != "LORA":
            return adapter_failure("AdapterLoadFailed", name, f"{CONFIG_FILE} is not a LoRA adapter's")
        rank = config.get("r")
        if not isinstance(rank, int) or rank < 1:
            return adapter_failure("AdapterLoadFailed", name, f"{CONFIG_FILE} has no rank r")
        if rank > self.max_rank:
            return adapter_failure("AdapterRankTooLarge", name, f"rank {rank} > max_lora_rank {self.max_rank}")
        weights = [f for f in _files(root) if f.suffix in WEIGHT_SUFFIXES]
        if not weights:
            return adapter_failure("AdapterLoadFailed", name, "no weight file (adapter_model.safetensors)")
        for f in weights:
            if f.suffix != ".safetensors":
                continue
            try:
                shapes = _safetensors_shapes(f)
            except (OSError, ValueError) as exc:
                return adapter_failure("AdapterLoadFailed", name, f"unreadable weights {f.name}: {exc}")
            mismatch = self._base_mismatch(shapes)
            if mismatch is not None:
                return adapter_failure("AdapterBaseMismatch", name, f"made for another base model: {mismatch}")
        return rank

    def _base_mismatch(self, shapes: dict[str, list[int]]) -> str | None:
        """Where the adapter's LoRA matrices do not fit the base model's layers (None: they fit, or no base known)."""
        if self._base_shapes is None:
            return None
        for key, shape in shapes.items():
            for part, dim in ((".lora_A.weight", 1), (".lora_B.weight", 0)):
                if not key.endswith(part) or len(shape) != 2:
                    continue
                module = key.removeprefix(_PEFT_PREFIX).removesuffix(part)
                base = self._base_shapes.get(module + ".weight")
                if base is None:
                    return f"the base model has no layer {module}"
                if base[dim] != shape[dim]:  # A: (r, in features), B: (out features, r)
                    return f"{module} is {base} in the base model, the adapter's {part[1:7]} is {shape}"
        return None


def _files(root: Path) -> list[Path]:
    """The files that make an adapter: its config and its weights (tokenizer files and READMEs are not used)."""
    return sorted(f for f in root.iterdir() if f.is_file() and (f.name == CONFIG_FILE or f.suffix in WEIGHT_SUFFIXES))


def _stat(root: Path) -> tuple[Any, ...]:
    try:
        return tuple((f.name, f.stat().st_size, f.stat().st_mtime_ns) for f in _files(root))
    except OSError:
        return ()


def _digest(root: Path) -> str:
    """sha256 over the adapter's config and weight files (names and contents), as 16 hex digits like the model's."""
    h = hashlib.sha256()
    for f in _files(root):
        h.update(f.name.encode() + b"\0")
        with f.open("rb") as fh:
            for block in iter(lambda: fh.read(1 << 20), b""):
                h.update(block)
        h.update(b"\0")
    return h.hexdigest()[:16]


def _safetensors_shapes(path: Path) -> dict[str, list[int]]:
    """Tensor name -> shape from a safetensors file's header alone (no tensor is read)."""
    return {k: list(v["shape"]) for k, v in safetensors_header(path).items()}


def safetensors_header(path: Path) -> dict[str, dict[str, Any]]:
    """Tensor name -> its header entry (``dtype``, ``shape``, ``data_offsets``), read without loading a tensor."""
    with path.open("rb") as fh:
        raw = fh.read(8)
        if len(raw) != 8:
            raise ValueError("truncated header")
        (size,) = struct.unpack("<Q", raw)
        if size > 100_000_000 or size > path.stat().st_size - 8:
            raise ValueError("header length beyond the file")
        header = json.loads(fh.read(size))
    if not isinstance(header, dict):
        raise ValueError("header is not a JSON object")
    tensors = {k: v for k, v in header.items() if k != "__metadata__"}
    if not all(isinstance(v, dict) and isinstance(v.get("shape"), list) for v in tensors.values()):
        raise ValueError("header entries are not tensors")
    return tensors


def _model_shapes(model: Path) -> dict[str, list[int]] | None:
    """The base model's weight shapes by name (from its safetensors headers), or None when it has none to read."""
    shapes: dict[str, list[int]] = {}
    for f in sorted(model.glob("*.safetensors")):
        try:
            shapes.update(_safetensors_shapes(f))
        except (OSError, ValueError) as exc:
            log.warning("adapters: cannot read the base model's %s (%s); shapes not checked", f.name, exc)
            return None
    return shapes or None
