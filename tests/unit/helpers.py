"""Pure-stage helpers: WorkItems and configs without a broker."""

from __future__ import annotations

from typing import Any

from batchline.config import JobConfig, load_job_config
from consumers.work import Failure, Source, WorkItem
from schemas import Request


def config(**overrides: Any) -> JobConfig:
    return load_job_config("unit", None, overrides)


def item(
    rid: str,
    text: str = "some words here",
    offset: int = 0,
    partition: int = 0,
    tokens: int | None = None,
    failure: Failure | None = None,
    attempt: int = 1,
) -> WorkItem:
    req = Request(id=rid, prompt=text)
    return WorkItem(
        source=Source("unit.requests", partition, offset),
        key=rid.encode(),
        payload=b"{}",
        headers={},
        request=req,
        request_id=rid,
        prompt=text,
        prompt_tokens=len(text.split()) if tokens is None else tokens,
        failure=failure,
        attempt=attempt,
    )
