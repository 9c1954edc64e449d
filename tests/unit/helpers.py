"""Pure-stage helpers: WorkItems and configs without a broker, and one OpenAI body field converted as the field
table converts it."""

from __future__ import annotations

from typing import Any

import pytest

from batchline.config import JobConfig, load_job_config
from batchline.runs.openai_convert import Converter, Line, LineError
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


STAGE_TIMEOUT_S = 30.0


def run_stage(cfg: JobConfig, engine: Any, items: list[WorkItem]) -> dict[int, Any]:
    """The infer stage (engine thread included) on one micro-batch: its outcomes by index."""
    import threading
    import time

    from consumers.infer import Feeder, Flight

    woken = threading.Event()
    feeder = Feeder(engine, cfg, woken.set)
    feeder.start()
    flight = Flight("unit-1", items)
    try:
        feeder.submit(flight)
        deadline = time.monotonic() + STAGE_TIMEOUT_S
        while not flight.done:
            assert feeder.error is None, feeder.error
            assert time.monotonic() < deadline, "the infer stage did not finish the micro-batch"
            woken.wait(0.1)
            woken.clear()
    finally:
        feeder.close()
    return flight.outcomes


def convert_field(convert: Converter, name: str, line: Line) -> Line:
    """``convert`` run on the body's ``name``, as the table runs it: the value, the line, ``body.<name>``."""
    convert(line.body[name], line, f"body.{name}")
    return line


def refusal(convert: Converter, name: str, line: Line) -> LineError:
    """The LineError ``convert`` raises for the body's ``name`` (the test fails if it raises none)."""
    with pytest.raises(LineError) as caught:
        convert_field(convert, name, line)
    return caught.value
