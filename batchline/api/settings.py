"""What one ``batchline api`` process serves: its models (each a job with its config), its tenants' keys, its topics.

- :class:`ModelRoute`: a model name clients ask for (``--model NAME=JOB``) and the job that serves it, with the
  job's config (``--config JOB=PATH``; default: the job's defaults), so the API knows the job's task (which
  endpoints fit it) and the fingerprint its runs are pinned to, computed as ``submit`` computes it.
- :func:`load_keys`: API keys per tenant from ``BATCHLINE_API_KEYS`` (``tenant:key,...``) or the file named by
  ``BATCHLINE_API_KEYS_FILE`` (one ``tenant:key`` a line: a mounted Kubernetes secret). Keys are compared in
  constant time and never appear in a message.
- :class:`ApiTopics`: the API's own topics (files, their content, batches), named from one prefix.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, replace
from pathlib import Path

from batchline.config import JobConfig
from batchline.exceptions import ConfigError
from batchline.kafka.topics import JobTopics
from batchline.runs.identity import Fingerprint, fingerprint_of
from batchline.runs.openai_lines import CHAT_ENDPOINT, COMPLETIONS_ENDPOINT, EMBEDDINGS_ENDPOINT, RESPONSES_ENDPOINT
from batchline.runs.openai_rows import ADAPTER_SEPARATOR

CHAT, COMPLETIONS, EMBEDDINGS = CHAT_ENDPOINT, COMPLETIONS_ENDPOINT, EMBEDDINGS_ENDPOINT
RESPONSES = RESPONSES_ENDPOINT
ENDPOINTS_BY_TASK: dict[str, tuple[str, ...]] = {
    "generate": (CHAT, COMPLETIONS, RESPONSES),
    "classify": (CHAT, COMPLETIONS),  # the label is the completion
    "embed": (EMBEDDINGS,),
}
KEYS_ENV = "BATCHLINE_API_KEYS"
KEYS_FILE_ENV = "BATCHLINE_API_KEYS_FILE"
DEFAULT_TOPIC_PREFIX = "batchline-api"


@dataclass(frozen=True)
class ModelRoute:
    """Model ``name`` is served by job ``config.job``; its batches become runs pinned to ``fingerprint``. A route of
    one of the job's LoRA adapters (``adapter`` set) is named ``<model>:<adapter>``: the same job and fingerprint."""

    name: str
    config: JobConfig
    fingerprint: Fingerprint
    adapter: str | None = None

    @classmethod
    def of(cls, name: str, config: JobConfig) -> ModelRoute:
        return cls(name, config, fingerprint_of(config))

    @property
    def job(self) -> str:
        return self.config.job

    @property
    def topics(self) -> JobTopics:
        return JobTopics(self.config.job, self.config.retry.tiers)

    @property
    def endpoints(self) -> tuple[str, ...]:
        return ENDPOINTS_BY_TASK[self.config.task]


def with_adapters(routes: Mapping[str, ModelRoute]) -> dict[str, ModelRoute]:
    """The routes and, for each base model whose job has LoRA adapters (``engine.lora``, its directory read now), a
    route ``<model>:<adapter>`` per adapter."""
    out = dict(routes)
    for name, route in routes.items():
        if route.adapter is None:
            for adapter in route.config.engine.lora.names():
                named = f"{name}{ADAPTER_SEPARATOR}{adapter}"
                out[named] = replace(route, name=named, adapter=adapter)
    return out


@dataclass(frozen=True)
class ApiTopics:
    """``P.files`` (compacted: file objects by id), ``P.file-chunks`` (compacted: content, keyed ``id/seq``),
    ``P.batches`` (compacted: batch records by id), ``P.webhook-endpoints`` and ``P.webhook-deliveries``
    (compacted: by endpoint id, by webhook id). A deletion is a tombstone under each key."""

    prefix: str = DEFAULT_TOPIC_PREFIX

    @property
    def files(self) -> str:
        return f"{self.prefix}.files"

    @property
    def chunks(self) -> str:
        return f"{self.prefix}.file-chunks"

    @property
    def batches(self) -> str:
        return f"{self.prefix}.batches"

    @property
    def webhook_endpoints(self) -> str:
        return f"{self.prefix}.webhook-endpoints"

    @property
    def webhook_deliveries(self) -> str:
        return f"{self.prefix}.webhook-deliveries"

    @property
    def deliverer_group(self) -> str:
        """The group whose one member delivers webhooks (the owner of ``webhook_deliveries``' partition)."""
        return f"{self.prefix}.webhook-deliverer"

    def all(self) -> list[str]:
        return [self.files, self.chunks, self.batches, self.webhook_endpoints, self.webhook_deliveries]


def parse_keys(text: str, separator: str, where: str) -> dict[str, str]:
    """``{key: tenant}`` from ``tenant:key`` entries split by ``separator``; blank entries and ``#`` lines skipped."""
    keys: dict[str, str] = {}
    for n, entry in enumerate(text.split(separator), 1):
        entry = entry.strip()
        if not entry or entry.startswith("#"):
            continue
        tenant, sep, key = entry.partition(":")
        if not sep or not tenant.strip() or not key.strip():
            raise ConfigError(f"{where}: entry {n} is not tenant:key")  # never quote it: it may hold a key
        if key.strip() in keys and keys[key.strip()] != tenant.strip():
            raise ConfigError(f"{where}: entry {n} gives a key already given to another tenant")
        keys[key.strip()] = tenant.strip()
    return keys


def load_keys(env: Mapping[str, str] | None = None) -> dict[str, str]:
    """The API keys (``{key: tenant}``) from ``BATCHLINE_API_KEYS`` and ``BATCHLINE_API_KEYS_FILE`` together."""
    env = os.environ if env is None else env
    keys = parse_keys(env.get(KEYS_ENV, ""), ",", KEYS_ENV)
    path = env.get(KEYS_FILE_ENV)
    if path:
        try:
            text = Path(path).read_text()
        except OSError as exc:
            raise ConfigError(f"{KEYS_FILE_ENV}: cannot read {path} ({exc.strerror or exc})") from None
        for key, tenant in parse_keys(text, "\n", f"{KEYS_FILE_ENV} {path}").items():
            if keys.setdefault(key, tenant) != tenant:
                raise ConfigError(f"{KEYS_FILE_ENV} {path}: gives a key of {KEYS_ENV} to another tenant")
    if not keys:
        raise ConfigError(f"no API keys: set {KEYS_ENV}=tenant:key,... or {KEYS_FILE_ENV}=PATH (one tenant:key a line)")
    return keys
