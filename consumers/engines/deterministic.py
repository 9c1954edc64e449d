"""A pure-Python engine with reproducible outputs and fault-injection knobs.

It is a real engine for pipeline tests and benchmarks: outputs depend only on (input, seed), so a replay
reproduces them, and every injected fault is a pure function of (request id, attempt, fault_seed), so a test
can compute exactly which ids must end where. Knobs (``[engine.deterministic]`` of the job config,
:class:`~batchline.config.DeterministicConfig`):

- ``latency_ms`` per record and ``batch_latency_ms`` per call: simulated compute time.
- ``transient_rate``: share of (id, attempt) pairs that fail with a transient Failure.
- ``poison_marker``: any call whose batch holds a record containing it raises (crashes), like a poison record.
- ``invalid_output_rate``: share of ids whose output never passes validation.
- ``oom_above``: calls with more records raise EngineOOM.
- ``embed_dim``: embedding size (default 32). ``fault_seed``: salt of the fault functions.
- ``hang_marker``: a call whose batch holds a record containing it blocks until the engine is closed (a hung
  engine: the worker keeps polling but completes no batch), then raises EngineError.
- ``load_gate``: a file path; the constructor waits until that file exists (a model that is still loading).

It batches like a GPU engine: a running batch of at most ``max_running`` records (default 256) advances one
step at a time, a step costs ``batch_latency_ms + latency_ms * running``, and a record finishes after one step -
or, with ``decode_steps = true``, after one step per completion token, so records of one batch finish at
different times as in vLLM. ``infer`` runs its inputs as a private running batch until all have finished (a
synchronous call that drains to its longest record); ``add``/``step`` keep one shared running batch that records
join and leave individually (continuous feeding, :class:`~consumers.engines.base.StreamingEngine`). A step whose
batch holds a poison record crashes; a step over ``oom_above`` records raises EngineOOM. ``streaming = False``
(``engine.streaming = false``) hides ``add``/``step``, so the worker drives it call by call.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import math
import threading
import time
import zlib
from collections.abc import Iterable, Sequence
from typing import Any

from batchline.config import DeterministicConfig
from consumers.engines.base import EngineInput, EngineOutput, Options, Outcome
from consumers.exceptions import EngineError, EngineOOM
from consumers.work import Failure
from schemas.models import Choice, StructuredOutput, TokenLogprob, ToolCall, TopLogprob

LOAD_GATE_POLL_S = 0.05


# A record in a running batch and the steps it still needs: a plain tuple (one per record), replaced when it steps
# without finishing (only with ``decode_steps``).
_Running = tuple[EngineInput, int]


class PoisonRecordCrash(RuntimeError):
    """What the engine 'crashes' with when a batch holds a poison record."""


def _unit(*parts: object) -> float:
    """A stable number in [0, 1) from the parts."""
    h = hashlib.sha256("\x1f".join(map(str, parts)).encode()).digest()
    return int.from_bytes(h[:8], "big") / 2**64


class DeterministicEngine:
    name = "deterministic"

    def __init__(
        self,
        task: str,
        labels: Sequence[str] = (),
        json_schema: dict[str, Any] | None = None,
        knobs: DeterministicConfig | None = None,
        streaming: bool = True,
    ) -> None:
        kw = knobs or DeterministicConfig()
        self.task = task
        self.labels = tuple(labels)
        self.json_schema = json_schema
        self.latency_s = kw.latency_ms / 1000
        self.batch_latency_s = kw.batch_latency_ms / 1000
        self.transient_rate = kw.transient_rate
        self.poison_marker = kw.poison_marker
        self.invalid_output_rate = kw.invalid_output_rate
        self.oom_above = kw.oom_above
        self.embed_dim = kw.embed_dim
        self.fault_seed = kw.fault_seed
        self.max_running = kw.max_running
        self.decode_steps = kw.decode_steps
        self.streaming = streaming
        self.calls = 0
        self.steps = 0
        self._running: dict[int, _Running] = {}
        self.hang_marker = kw.hang_marker
        self._closed = threading.Event()
        while kw.load_gate and not kw.load_gate.exists():
            time.sleep(LOAD_GATE_POLL_S)

    # -- the fault functions, public so tests can predict every outcome --------------------------
    def fails_transiently(self, request_id: str, attempt: int) -> bool:
        return (
            self.transient_rate > 0 and _unit("transient", self.fault_seed, request_id, attempt) < self.transient_rate
        )

    def gives_invalid_output(self, request_id: str) -> bool:
        return self.invalid_output_rate > 0 and _unit("invalid", self.fault_seed, request_id) < self.invalid_output_rate

    def is_poison(self, text: str) -> bool:
        return bool(self.poison_marker) and self.poison_marker in text  # type: ignore[operator]

    # -- the Engine protocol ---------------------------------------------------------------------
    def count_tokens(self, text: str) -> int:
        return len(text.split())

    def prompt_ids(self, text: str) -> list[int] | None:
        return None  # it reads the text

    def infer(self, inputs: Sequence[EngineInput]) -> list[Outcome]:
        self.calls += 1
        running = {i: (inp, self._steps_of(inp)) for i, inp in enumerate(inputs)}
        outcomes: dict[int, Outcome] = {}
        while running:
            outcomes.update(self._advance(running))
        return [outcomes[i] for i in range(len(inputs))]

    def close(self) -> None:
        self._closed.set()

    # -- continuous batching (StreamingEngine) ---------------------------------------------------
    def add(self, key: int, inp: EngineInput) -> Failure | None:
        self._running[key] = (inp, self._steps_of(inp) if self.decode_steps else 1)
        return None

    def step(self) -> list[tuple[int, Outcome]]:
        return list(self._advance(self._running).items())

    def running(self) -> int:
        return len(self._running)

    def abort(self, keys: Iterable[int] | None = None) -> list[int]:
        gone = list(self._running) if keys is None else [k for k in keys if k in self._running]
        for key in gone:
            del self._running[key]
        return gone

    def _steps_of(self, inp: EngineInput) -> int:
        if not self.decode_steps or self.task != "generate":
            return 1
        return max(1, min(inp.sampling.max_tokens, len(inp.prompt.split()) + 1))

    def _advance(self, running: dict[int, _Running]) -> dict[int, Outcome]:
        """One step of the first ``max_running`` records of ``running``; the ones that finished, removed."""
        batch = list(itertools.islice(running, self.max_running))
        self.steps += 1
        if self.oom_above is not None and len(batch) > self.oom_above:
            raise EngineOOM(f"simulated OOM: {len(batch)} records > {self.oom_above}")
        pause = self.batch_latency_s + self.latency_s * len(batch)
        if pause > 0:
            time.sleep(pause)
        if self.poison_marker and any(self.is_poison(running[k][0].prompt) for k in batch):
            raise PoisonRecordCrash("engine crashed on a poison record")
        if self.hang_marker and any(self.hang_marker in running[k][0].prompt for k in batch):
            self._closed.wait()
            raise EngineError("engine closed during a hung call")
        done: dict[int, Outcome] = {}
        for key in batch:
            inp, left = running[key]
            if left > 1:
                running[key] = (inp, left - 1)
            else:
                done[key] = self._one(inp)
                del running[key]
        return done

    # -- outputs ---------------------------------------------------------------------------------
    def _one(self, inp: EngineInput) -> Outcome:
        if self.transient_rate > 0 and self.fails_transiently(inp.request_id, inp.attempt):
            return Failure("transient", "InjectedTransientFault", f"injected fault on attempt {inp.attempt}")
        words = inp.prompt.split()
        invalid = self.invalid_output_rate > 0 and self.gives_invalid_output(inp.request_id)
        if self.task == "embed":
            if inp.options is not None:
                return self._embed_with(inp.options, inp.prompt, len(words))
            return EngineOutput(embedding=self._embedding(inp.prompt), prompt_tokens=len(words))
        if self.task == "classify":
            return self._classify(inp.prompt, len(words), invalid)
        if inp.options is not None:
            return self._generate_with(inp, inp.options, words, invalid)
        return self._generate(inp, words, invalid)

    def _embedding(self, text: str, dimensions: int | None = None, normalize: bool = True) -> list[float]:
        """The first ``dimensions`` of the text's vector (a Matryoshka truncation), normalised after truncation as
        vLLM's pooler does; ``normalize`` false: the raw values."""
        raw = [_unit("embed", text, i) - 0.5 for i in range(dimensions or self.embed_dim)]
        if not normalize:
            return raw
        norm = math.sqrt(sum(x * x for x in raw)) or 1.0
        return [x / norm for x in raw]

    def _embed_with(self, options: Options, prompt: str, tokens: int) -> Outcome:
        dimensions = options.dimensions
        if dimensions is not None and dimensions > self.embed_dim:
            return Failure(
                "invalid_input", "UnsupportedOption", f"dimensions: {dimensions} > the model's {self.embed_dim}"
            )
        normalize = options.normalize is not False
        if options.inputs is None:
            return EngineOutput(embedding=self._embedding(prompt, dimensions, normalize), prompt_tokens=tokens)
        vectors = [self._embedding(text, dimensions, normalize) for text in options.inputs]
        return EngineOutput(embeddings=vectors, prompt_tokens=sum(len(text.split()) for text in options.inputs))

    def _classify(self, text: str, tokens: int, invalid: bool) -> Outcome:
        if not self.labels:
            return Failure("invalid_input", "NoLabels", "classify job has no labels")
        lowered = text.lower()
        raw = {lab: (1.0 if lab.lower() in lowered else 0.0) + _unit("cls", text, lab) * 0.5 for lab in self.labels}
        total = sum(math.exp(v) for v in raw.values())
        scores = {lab: math.exp(v) / total for lab, v in raw.items()}
        label = max(scores, key=lambda k: scores[k])
        if invalid:
            label = "__not_a_label__"
        return EngineOutput(label=label, scores=scores, prompt_tokens=tokens, finish_reason="stop")

    def _generate(self, inp: EngineInput, words: list[str], invalid: bool) -> Outcome:
        s = inp.sampling
        # Greedy (temperature 0) outputs ignore the seed, as a real engine's would.
        salt = f"|{s.seed}".encode() if s.temperature > 0 else b"|0"
        if inp.adapter is not None:  # another adapter (or version) is another model: another output
            salt += f"|{inp.adapter.name}@{inp.adapter.digest}".encode()
        tag = f"{zlib.crc32(salt, zlib.crc32(inp.prompt.encode())):08x}"  # the CRC of f"{prompt}|{salt}"
        keep = max(1, s.max_tokens - 1)  # the first `keep` words, in reverse order
        if self.json_schema is not None:
            text = "not json" if invalid else json.dumps(_instance(self.json_schema, tag))
            completion = len(text.split())
        elif invalid:
            text, completion = "", 0
        else:
            text, completion = tag + " " + " ".join(words[keep - 1 :: -1]), min(keep, len(words)) + 1
        # positional: text, label, scores, embedding, finish_reason, prompt_tokens, completion_tokens
        return EngineOutput(
            text, None, None, None, "length" if completion >= s.max_tokens else "stop", len(words), completion
        )

    def _generate_with(self, inp: EngineInput, options: Options, words: list[str], invalid: bool) -> Outcome:
        """A record with options of its own: ``n`` choices (the same ones when greedy, as a real engine's), each cut
        by its stop strings and stop token ids no earlier than ``min_tokens``, with log-probabilities when asked;
        structured outputs (JSON schema, JSON object, choice) and required tool calls are made to fit. A regex or a
        grammar cannot be generated here: refused by name."""
        structured = options.structured
        if structured is not None and structured.kind in ("regex", "grammar"):
            why = f"structured.{structured.kind}: the deterministic engine cannot generate from a {structured.kind}"
            return Failure("invalid_input", "UnsupportedOption", why)
        choices = [self._choice(i, inp, options, words, invalid) for i in range(options.n)]
        first = choices[0]
        completion = sum(c.completion_tokens for c in choices)
        detailed = choices if options.detailed else None
        return EngineOutput(first.text, None, None, None, first.finish_reason, len(words), completion, detailed)

    def _choice(self, index: int, inp: EngineInput, options: Options, words: list[str], invalid: bool) -> Choice:
        s = inp.sampling
        # Greedy (temperature 0) outputs ignore the seed, as a real engine's would; sampled choices differ by index.
        salt = f"|{(s.seed or 0) + index}".encode() if s.temperature > 0 else b"|0"
        if inp.adapter is not None:
            salt += f"|{inp.adapter.name}@{inp.adapter.digest}".encode()
        tag = f"{zlib.crc32(salt, zlib.crc32(inp.prompt.encode())):08x}"
        if options.calls_tools:
            return self._tool_choice(index, options, tag)
        structured = options.structured
        if structured is not None and not invalid:
            text = _structured_text(structured, tag)
            count = len(text.split())
            return Choice(index=index, text=text, finish_reason="stop", completion_tokens=count)
        keep = max(1, s.max_tokens - 1)
        tokens = [] if invalid else [tag, *words[keep - 1 :: -1]]
        while len(tokens) < min(options.min_tokens, s.max_tokens):
            tokens.append("pad")
        finish = "length" if len(tokens) >= s.max_tokens else "stop"
        cut = _stop_at(tokens, options)
        if cut is not None:
            tokens, finish = tokens[:cut], "stop"
        text = " ".join(tokens)
        if cut is None and not invalid and len(words) == 0:
            text += " "  # the plain path's spelling (tag, a space, no words): one output for one input
        if options.stop:  # the earlier of the two ends the output: a stop string before a stop token's cut
            text, found = _cut_at_stop_string(text, options.stop, options.min_tokens)
            if found:
                finish = "stop"
                tokens = text.split()
        logprobs = _logprobs(tokens, options.logprobs, tag) if options.logprobs is not None else None
        return Choice(index=index, text=text, finish_reason=finish, completion_tokens=len(tokens), logprobs=logprobs)

    def _tool_choice(self, index: int, options: Options, tag: str) -> Choice:
        tools = options.tools or ()
        name = options.forced_tool or str(tools[0]["function"]["name"])
        function = next(t["function"] for t in tools if t["function"]["name"] == name)
        arguments = json.dumps(_instance(function.get("parameters", {"type": "object"}), tag))
        call = ToolCall(id=f"call_{tag}{index}", name=name, arguments=arguments)
        return Choice(
            index=index,
            text=None,
            finish_reason="tool_calls",
            completion_tokens=len(arguments.split()),
            tool_calls=[call],
        )


VOCAB = 50_000  # the deterministic engine's token ids: a word's CRC-32 modulo this


def token_id(word: str) -> int:
    return zlib.crc32(word.encode()) % VOCAB


def _stop_at(tokens: list[str], options: Options) -> int | None:
    """Where a stop token id ends the output (the token itself is not output, as vLLM's default), not before
    ``min_tokens``; None when none does."""
    if not options.stop_token_ids:
        return None
    stops = set(options.stop_token_ids)
    for at in range(options.min_tokens, len(tokens)):
        if token_id(tokens[at]) in stops:
            return at
    return None


def _cut_at_stop_string(text: str, stops: Sequence[str], min_tokens: int) -> tuple[str, bool]:
    """The text up to the earliest stop string (excluded, as vLLM's default) that starts after ``min_tokens``
    words; whether one was found."""
    floor = len(" ".join(text.split(" ")[:min_tokens])) if min_tokens else 0
    found = [at for at in (text.find(stop, floor) for stop in stops) if at >= 0]
    if not found:
        return text, False
    return text[: min(found)], True


def _logprobs(tokens: list[str], top: int, tag: str) -> list[TokenLogprob]:
    """A log-probability per token, reproducible, with ``top`` alternatives (the sampled token first: a greedy
    engine's sampled token is its most likely one)."""
    out = []
    for at, word in enumerate(tokens):
        best = -_unit("logprob", tag, at, word) * 2
        alternatives = [TopLogprob(token=word, token_id=token_id(word), logprob=best)]
        for k in range(1, top):
            alt = f"{word}~{k}"
            alternatives.append(TopLogprob(token=alt, token_id=token_id(alt), logprob=best - k - _unit(alt, at)))
        out.append(TokenLogprob(token=word, token_id=token_id(word), logprob=best, top=alternatives[:top]))
    return out


def _structured_text(structured: StructuredOutput, tag: str) -> str:
    if structured.kind == "json_schema":
        assert structured.json_schema is not None
        return json.dumps(_instance(json.loads(structured.json_schema), tag))
    if structured.kind == "json_object":
        return json.dumps({"tag": tag})
    choices = structured.choice or ()
    return choices[int(tag, 16) % len(choices)]


def _instance(schema: dict[str, Any], tag: str) -> Any:
    """A small value that satisfies a simple JSON schema (object/array/string/number/integer/boolean/enum)."""
    if "enum" in schema:
        return schema["enum"][int(tag, 16) % len(schema["enum"])]
    kind = schema.get("type", "object")
    if kind == "object":
        props: dict[str, Any] = schema.get("properties", {})
        return {k: _instance(v, tag) for k, v in props.items()}
    if kind == "array":
        return [_instance(schema.get("items", {"type": "string"}), tag)]
    if kind == "integer":
        return int(tag, 16) % 100
    if kind == "number":
        return (int(tag, 16) % 1000) / 10
    if kind == "boolean":
        return int(tag, 16) % 2 == 0
    return tag
