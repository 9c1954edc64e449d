"""What one record becomes for vLLM, and what vLLM's answer becomes for the record: the vLLM engine's per-record part.

:class:`VLLMRequests` is the base of :class:`~consumers.engines.vllm.VLLMEngine`: a record's prompt token ids
(checked against ``max_model_len``), its vLLM ``SamplingParams`` or ``PoolingParams``, the ``EngineOutput`` of a
finished generation or of pooled vectors (classify by label-embedding similarity included), and a failed vLLM call
read as a record's own problem (a ``Failure``) or the engine-level error it is. The engine sets the attributes
declared here when it starts; nothing here calls vLLM's engine loop.
"""

from __future__ import annotations

import logging
from typing import Any

from batchline.config import JobConfig
from consumers.engines.base import EngineInput, EngineOutput, Options, Outcome
from consumers.engines.vllm_records import by_similarity, choice_of, constraint, field_of
from consumers.engines.vllm_watchdog import is_oom
from consumers.exceptions import EngineError, EngineOOM
from consumers.work import Failure

log = logging.getLogger(__name__)


class VLLMRequests:
    """A record's vLLM request and its outcome; the base of ``VLLMEngine``, which sets these attributes."""

    config: JobConfig
    task: str
    max_model_len: int
    labels: tuple[str, ...]
    by_embedding: bool
    tokenizer: Any
    _vllm: Any  # the vllm module, imported when the engine starts
    _llm: Any  # the vllm.LLM, None while stopped
    _structured: Any  # vllm's StructuredOutputsParams
    _tool_parser: Any
    _label_vectors: Any

    def close(self) -> None:
        """The engine's (``VLLMEngine.close``): a dead or hung engine is closed before its error is raised."""
        raise NotImplementedError

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
