"""Output validation per job: JSON schema, allowed labels, length limits, embedding shape."""

from __future__ import annotations

import json
import math
from typing import Any

import jsonschema

from batchline.config import JobConfig
from consumers.engines.base import EngineOutput


class OutputValidator:
    def __init__(self, config: JobConfig) -> None:
        self.task = config.task
        self.rules = config.validation
        schema = self.rules.json_schema or config.engine.json_schema
        self._schema: Any = jsonschema.Draft202012Validator(schema) if schema else None
        labels = self.rules.allowed_labels if self.rules.allowed_labels is not None else config.engine.labels
        self.labels = frozenset(labels)
        self._min_chars = max(1, self.rules.min_output_chars)

    def problem(self, out: EngineOutput) -> str | None:
        """Why ``out`` is not acceptable, or None."""
        if self.task == "embed":
            if not out.embedding:
                return "empty embedding"
            if not all(math.isfinite(x) for x in out.embedding):
                return "embedding has non-finite values"
            return None
        if self.task == "classify":
            if out.label is None:
                return "no label"
            if self.labels and out.label not in self.labels:
                return f"label {out.label!r} not in the allowed set"
            return None
        text = out.text or ""
        shortest = self._min_chars
        # strip() copies the text: only when whitespace at an end could make it too short
        if len(text) < shortest or ((text[0].isspace() or text[-1].isspace()) and len(text.strip()) < shortest):
            return f"output shorter than {shortest} chars"
        if self.rules.max_output_chars is not None and len(text) > self.rules.max_output_chars:
            return f"output longer than {self.rules.max_output_chars} chars"
        if self._schema is not None:
            try:
                doc = json.loads(text)
            except json.JSONDecodeError as exc:
                return f"output is not JSON: {exc.msg}"
            err = next(iter(self._schema.iter_errors(doc)), None)
            if err is not None:
                return f"output violates the JSON schema: {err.message}"
        return None
