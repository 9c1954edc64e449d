"""Inference engines behind the :class:`Engine` protocol, and the factory that picks one from the job config."""

from __future__ import annotations

from batchline.config import JobConfig
from consumers.engines.base import Engine, EngineInput, EngineOutput, Outcome, Sampling
from consumers.exceptions import EngineStartError
from consumers.work import Failure

__all__ = ["Engine", "EngineInput", "EngineOutput", "Failure", "Outcome", "Sampling", "create_engine"]


def create_engine(config: JobConfig) -> Engine:
    """The engine named by ``config.engine.name``, started once per worker process."""
    eng = config.engine
    if eng.name == "deterministic":
        from consumers.engines.deterministic import DeterministicEngine

        return DeterministicEngine(config.task, eng.labels, eng.json_schema, eng.deterministic, eng.streaming)
    if eng.name == "vllm":
        try:
            from consumers.engines.vllm import VLLMEngine
        except ImportError as exc:
            raise EngineStartError(f"vllm engine unavailable ({exc}); install the cpu or gpu extra") from None
        return VLLMEngine(config)
    raise EngineStartError(f"unknown engine {eng.name!r}")
