"""Intake: a Kafka message becomes a WorkItem - decoded, validated, its prompt rendered and counted.

Nothing raised here: a bad record becomes a WorkItem with an ``invalid_input`` failure, so it rides in its
batch (its offset is committed with its neighbours') and leaves as a dead letter. That includes a record whose own
options this job cannot honour (``batchline.runs.request_options``): refused by name, never ignored; and a record
with an image a worker must not pass on (``schemas.images``: remote, too large, a bomb, undecodable). A record
whose remote images the job allows has their fetch started by :meth:`Intake.start_fetch`, on the fetcher's own
threads (``consumers.fetch``), once the worker knows the record runs here.
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import UTC, datetime

from confluent_kafka import Message

from batchline.config import JobConfig
from batchline.kafka import headers as h
from consumers.engines.adapters import AdapterBook, adapter_failure
from consumers.fetch import ImageFetcher
from consumers.options import refused
from consumers.work import Failure, Source, WorkItem
from schemas.codec import DecodeError, decode_request, fallback_id
from schemas.images import ImageLimits, has_images
from schemas.images import problem as image_problem

TokenCounter = Callable[[str], int]
PromptEncoder = Callable[[str], "list[int] | None"]  # Engine.prompt_ids


_new_tuple = tuple.__new__
NO_HEADERS: dict[str, bytes] = {}  # shared by every record without headers (most of them): read, never written


def render_prompt(template: str, text: str) -> str:
    # str.replace, not str.format: record text may hold braces. The default template is the text itself.
    return text if template == "{input}" else template.replace("{input}", text)


def image_limits(config: JobConfig) -> ImageLimits:
    """The job's per-record image bounds, and the remote URL prefixes it allows to be fetched."""
    limits = config.limits
    return ImageLimits(
        limits.max_image_bytes,
        limits.max_image_pixels,
        limits.max_images_per_message,
        config.images.fetch.allow,
    )


class Intake:
    def __init__(
        self,
        config: JobConfig,
        count_tokens: TokenCounter,
        adapters: AdapterBook | None = None,
        fetcher: ImageFetcher | None = None,
    ) -> None:
        self.config = config
        self.count_tokens = count_tokens
        # set with count_tokens once the engine has loaded (Worker._engine_loaded), on the poll thread like admit()
        self.encode: PromptEncoder | None = None
        self.adapters = adapters
        self.fetcher = fetcher  # the job's allowed remote images (images.fetch); None: every remote URL is refused
        # read once a record: kept here, not looked up through the config each time
        self._generate = config.task == "generate"
        self._max_bytes = config.max_request_bytes
        self._template = config.engine.prompt_template
        self._max_model_len = config.engine.max_model_len
        self._image_limits = image_limits(config)

    def admit(self, msg: Message) -> WorkItem:
        raw_headers = msg.headers()
        headers = h.as_dict(raw_headers) if raw_headers else NO_HEADERS
        ts_type, ts = msg.timestamp()
        payload: bytes = msg.value() or b""
        # tuple.__new__, not Source(...): a NamedTuple's own __new__ is Python, twice the cost, once a record
        source = _new_tuple(Source, (msg.topic(), msg.partition(), msg.offset(), ts if ts_type else None))
        item = WorkItem(source, msg.key(), payload, headers)
        if headers:
            item.attempt = h.integer(headers, h.ATTEMPT, 0) + 1
            item.trace_parent = h.text(headers, h.TRACEPARENT)
            first = h.integer(headers, h.FIRST_FAILURE_AT, 0)
            if first:
                item.first_failure_at = datetime.fromtimestamp(first / 1000, UTC)
        try:
            item.request = decode_request(payload, self._max_bytes)
        except DecodeError as exc:
            item.request_id = fallback_id(item.key, payload)
            item.failure = Failure("invalid_input", "DecodeError", str(exc))
            return item
        request = item.request
        item.request_id = request.id
        if self._generate and request.text is not None:
            item.failure = Failure("invalid_input", "WrongInput", "generate jobs take prompt or messages, not text")
            return item
        if not self._generate and request.text is None and request.prompt is None and request.inputs is None:
            item.failure = Failure("invalid_input", "WrongInput", f"{self.config.task} jobs take text or prompt")
            return item
        if request.adapter is not None and (failure := self._adapter(item, request.adapter)) is not None:
            item.failure = failure
            return item
        if not request.plain and (failure := refused(request, self.config)) is not None:
            item.failure = failure
            return item
        if request.messages is not None and has_images(request.messages):
            found = image_problem(request.messages, self._image_limits)
            if found is not None:
                item.failure = Failure("invalid_input", found.error_type, found.message)
                return item
        item.prompt = prompt = render_prompt(self._template, request.input_text)
        if request.inputs is None and request.messages is None and self.encode is not None:
            # the engine's own ids, kept for it (EngineInput.prompt_ids): a prompt is encoded once, and here on the
            # poll thread rather than on the engine thread, where vLLM waits for it
            ids = item.prompt_ids = self.encode(prompt)
            item.prompt_tokens = tokens = len(ids) if ids is not None else self.count_tokens(prompt)
        elif request.inputs is None:
            item.prompt_tokens = tokens = self.count_tokens(prompt)
        else:  # several texts, embedded one by one: each must fit
            counts = [self.count_tokens(render_prompt(self._template, text)) for text in request.inputs]
            item.prompt_tokens, tokens = sum(counts), max(counts)
        limit = self._max_model_len
        if tokens > limit:
            item.failure = Failure(
                "invalid_input",
                "PromptTooLong",
                f"prompt has {tokens} tokens > max_model_len {limit}",
            )
        return item

    def start_fetch(self, item: WorkItem) -> None:
        """Begin fetching the record's remote images the job allows, on the fetcher's threads (the record waits
        in the batcher meanwhile). Called once the record is known to run here (not passed over)."""
        request = item.request
        if self.fetcher is not None and item.runnable and request is not None and request.messages is not None:
            item.fetching = self.fetcher.start(request.messages)

    def _adapter(self, item: WorkItem, name: str) -> Failure | None:
        """Set the record's adapter (its current version), or say why it cannot have one."""
        if not self._generate:
            return adapter_failure(
                "UnsupportedOption", name, f"LoRA adapters serve generate jobs, not {self.config.task}"
            )
        if self.adapters is None:
            return adapter_failure("UnknownAdapter", name, "this job has no adapters (engine.lora)")
        adapter = self.adapters.resolve(name)
        if isinstance(adapter, Failure):
            return adapter
        item.adapter = adapter
        return None
