"""Output validation: the job's rules (JSON schema, allowed labels, length limits, embedding shape) and a record's
own (its structured-output constraint, tool calls it required). An output that breaks them takes the
``invalid_output`` path: re-inferred with a new seed, then dead-lettered."""

from __future__ import annotations

import json
import math
import re
from typing import Any

import jsonschema

from batchline.config import JobConfig
from consumers.engines.base import EngineOutput, Options
from schemas.models import StructuredOutput

COMPILED_CACHE = 256  # per-record schemas and patterns kept compiled (records of one run usually share a few)


class OutputValidator:
    def __init__(self, config: JobConfig) -> None:
        self.task = config.task
        self.rules = config.validation
        schema = self.rules.json_schema or config.engine.json_schema
        self._schema: Any = jsonschema.Draft202012Validator(schema) if schema else None
        labels = self.rules.allowed_labels if self.rules.allowed_labels is not None else config.engine.labels
        self.labels = frozenset(labels)
        self._min_chars = max(1, self.rules.min_output_chars)
        self._compiled: dict[tuple[str, str], Any] = {}

    def problem(self, out: EngineOutput, options: Options | None = None) -> str | None:
        """Why ``out`` is not acceptable for a record with ``options``, or None."""
        if self.task == "embed":
            vectors = out.embeddings if out.embeddings is not None else [out.embedding or []]
            for vector in vectors:
                if not vector:
                    return "empty embedding"
                if not all(math.isfinite(x) for x in vector):
                    return "embedding has non-finite values"
            dimensions = options.dimensions if options is not None else None
            if dimensions is not None and any(len(v) != dimensions for v in vectors):
                return f"embedding size is not the {dimensions} dimensions asked"
            return None
        if self.task == "classify":
            if out.label is None:
                return "no label"
            if self.labels and out.label not in self.labels:
                return f"label {out.label!r} not in the allowed set"
            return None
        if options is None:
            return self._text_problem(out.text or "", None)
        if options.calls_tools:
            for choice in out.choices or ():
                if not choice.tool_calls:
                    return "the record required a tool call; the output has none"
        for choice in out.choices or ():
            for call in choice.tool_calls or ():
                problem = self._arguments_problem(call.name, call.arguments, options)
                if problem is not None:
                    return problem
        if options.calls_tools:
            return None
        if out.choices is None:
            return self._text_problem(out.text or "", options.structured)
        for choice in out.choices:
            if choice.tool_calls:
                continue  # a call chosen under tool_choice "auto": its text is not the answer
            problem = self._text_problem(choice.text or "", options.structured)
            if problem is not None:
                return problem if len(out.choices) == 1 else f"choice {choice.index}: {problem}"
        return None

    def _arguments_problem(self, name: str, arguments: str, options: Options) -> str | None:
        """A tool call must name an offered function, with arguments that obey its parameters' schema."""
        function = next((t["function"] for t in options.tools or () if t["function"]["name"] == name), None)
        if function is None:
            return f"tool call names {name!r}, not an offered function"
        schema = function.get("parameters", {"type": "object"})
        problem = _schema_problem(self._compile("json_schema", json.dumps(schema, sort_keys=True)), arguments)
        return None if problem is None else f"tool call {name!r}: {problem.replace('output', 'arguments', 1)}"

    def _text_problem(self, text: str, structured: StructuredOutput | None) -> str | None:
        shortest = self._min_chars
        # strip() copies the text: only when whitespace at an end could make it too short
        if len(text) < shortest or ((text[0].isspace() or text[-1].isspace()) and len(text.strip()) < shortest):
            return f"output shorter than {shortest} chars"
        if self.rules.max_output_chars is not None and len(text) > self.rules.max_output_chars:
            return f"output longer than {self.rules.max_output_chars} chars"
        if structured is not None:
            return self._structured_problem(text, structured)
        if self._schema is not None:
            return _schema_problem(self._schema, text)
        return None

    def _structured_problem(self, text: str, structured: StructuredOutput) -> str | None:
        kind = structured.kind
        if kind == "json_schema":
            assert structured.json_schema is not None
            validator = self._compile(kind, structured.json_schema)
            return _schema_problem(validator, text)
        if kind == "json_object":
            try:
                doc = json.loads(text)
            except ValueError as exc:
                return f"output is not JSON: {exc}"
            return None if isinstance(doc, dict) else "output is not a JSON object"
        if kind == "choice":
            return None if text in (structured.choice or ()) else "output is not one of the record's choices"
        if kind == "regex":
            assert structured.regex is not None
            pattern = self._compile(kind, structured.regex)
            # a pattern Python's re cannot read (the engine's regex dialect differs slightly) is the engine's alone
            if pattern is not None and pattern.fullmatch(text) is None:
                return "output does not match the record's regex"
        return None  # grammar: only the engine that applied it can tell

    def _compile(self, kind: str, source: str) -> Any:
        key = (kind, source)
        compiled = self._compiled.get(key)
        if compiled is None and key not in self._compiled:
            if len(self._compiled) >= COMPILED_CACHE:
                self._compiled.clear()
            if kind == "json_schema":
                compiled = jsonschema.Draft202012Validator(json.loads(source))
            else:
                try:
                    compiled = re.compile(source)
                except re.error:
                    compiled = None
            self._compiled[key] = compiled
        return compiled


def _schema_problem(validator: Any, text: str) -> str | None:
    try:
        doc = json.loads(text)
    except json.JSONDecodeError as exc:
        return f"output is not JSON: {exc.msg}"
    err = next(iter(validator.iter_errors(doc)), None)
    if err is not None:
        return f"output violates the JSON schema: {err.message}"
    return None
