"""The infer stage: engine inputs from work items, an isolated engine run, validated outcomes.

An output that fails validation is re-inferred with a new seed up to ``retry.invalid_output_retries`` times,
then becomes an ``invalid_output`` failure carrying the last output.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import replace

from batchline.config import JobConfig
from consumers.engines.base import EngineInput, EngineOutput, RecordFailure, Sampling
from consumers.isolate import IsolatingRunner
from consumers.validate import OutputValidator
from consumers.work import Failure, WorkItem

Outcome = EngineOutput | Failure
RETRY_TEMPERATURE = 0.7


def record_seed(base: int, request_id: str, salt: int = 0) -> int:
    """A per-record seed: stable for (base, id), so a replay reproduces sampled outputs."""
    h = hashlib.sha256(f"{base}|{request_id}|{salt}".encode()).digest()
    return int.from_bytes(h[:4], "big")


def engine_input(config: JobConfig, item: WorkItem) -> EngineInput:
    assert item.request is not None
    job = config.engine.sampling
    over = item.request.sampling
    seed = over.seed if over and over.seed is not None else record_seed(job.seed, item.request_id)
    sampling = Sampling(
        temperature=over.temperature if over and over.temperature is not None else job.temperature,
        top_p=over.top_p if over and over.top_p is not None else job.top_p,
        max_tokens=over.max_tokens if over and over.max_tokens is not None else job.max_tokens,
        seed=seed,
    )
    messages = tuple(item.request.messages) if item.request.messages else None
    return EngineInput(item.request_id, item.prompt, messages, sampling, item.attempt)


class InferStage:
    def __init__(self, config: JobConfig, runner: IsolatingRunner) -> None:
        self.config = config
        self.runner = runner
        self.validator = OutputValidator(config)

    def run(self, items: Sequence[WorkItem]) -> dict[int, Outcome]:
        """Outcomes of the runnable items, keyed by their index in ``items``."""
        todo = {i: engine_input(self.config, it) for i, it in enumerate(items) if it.runnable}
        outcomes: dict[int, Outcome] = {}
        last_invalid: dict[int, str] = {}
        for round_ in range(self.config.retry.invalid_output_retries + 1):
            if not todo:
                break
            keys = list(todo)
            results = self.runner.run([todo[k] for k in keys])
            retry: dict[int, EngineInput] = {}
            for k, res in zip(keys, results, strict=True):
                if isinstance(res, RecordFailure):
                    outcomes[k] = Failure(res.failure_class, res.error_type, res.message)
                    continue
                problem = self.validator.problem(res)
                if problem is None:
                    outcomes[k] = res
                    continue
                last_invalid[k] = res.text if res.text is not None else str(res.label or res.embedding)
                outcomes[k] = Failure("invalid_output", "InvalidOutput", problem, last_invalid[k][:2000])
                s = todo[k].sampling
                # A new seed only changes a sampled output: re-tries sample even when the job is greedy.
                resampled = replace(
                    s,
                    seed=record_seed(s.seed, todo[k].request_id, round_ + 1),
                    temperature=max(s.temperature, RETRY_TEMPERATURE),
                )
                retry[k] = replace(todo[k], sampling=resampled)
            todo = retry
        return outcomes
