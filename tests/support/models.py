"""Models for the vLLM tests, all local: a tiny Llama built on the spot, MiniLM (docs/architecture.md#engines)."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from batchline.config import JobConfig, KafkaSettings
from consumers.engines.base import EngineInput, Outcome
from consumers.work import Failure

# A chat template in the tokenizer, so chat records go through the model's own template as in production.
CHAT_TEMPLATE = (
    "{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)
_CORPUS = (
    "summarise the ticket about the order that did not arrive",
    'reply in json: {"label": "billing", "score": 3, "urgent": true}',
    "hello world, the quick brown fox jumps over the lazy dog 0123456789",
    "user: where is my parcel? assistant: it ships tomorrow.",
)


def build_tiny_llama(out: Path, layers: int = 2, hidden: int = 256) -> Path:
    """A 2-layer Llama (hidden 256, 4 heads: head_dim 64, which the CPU attention accepts) with a byte-level
        BPE tokenizer trained here. Random weights: outputs are noise, but every code path is the real one. ``layers``:
        fewer make a faster engine (the benchmarks' fast-engine case). ``hidden``: another width is another base model
    (a LoRA adapter made for one does not fit the other)."""
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    out.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=512,
        special_tokens=["<s>", "</s>", "<unk>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),  # every byte: any text, any JSON, is encodable
    )
    tok.train_from_iterator(list(_CORPUS) * 20, trainer)
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>")
    hf.chat_template = CHAT_TEMPLATE
    hf.save_pretrained(out)
    config = LlamaConfig(
        vocab_size=len(hf),
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=512,
        bos_token_id=hf.bos_token_id,
        eos_token_id=hf.eos_token_id,
        tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(out)
    return out


def minilm_path() -> Path:
    from batchline.cli.demo import packaged_model

    return packaged_model()


def cut_minilm(out: Path, layers: int) -> Path:
    """The packaged MiniLM with only its first ``layers`` transformer layers (of 6): the same tokenizer, pooling
    and embeddings, a faster engine (the benchmarks' fast-embedding case). Outputs differ from the full model's."""
    import shutil

    from transformers import BertModel

    shutil.copytree(minilm_path(), out, dirs_exist_ok=True)
    model = BertModel.from_pretrained(out)
    model.encoder.layer = model.encoder.layer[:layers]
    model.config.num_hidden_layers = layers
    model.save_pretrained(out)
    return out


class SharedEngine:
    """The module's engine lent to one Worker at a time: the worker's close() must not stop it. It streams
    (continuous batching) exactly when the engine it wraps does."""

    def __init__(self, engine: Any) -> None:
        self.inner = engine
        self.name: str = engine.name
        self.task: str = engine.task
        self.streaming: bool = bool(getattr(engine, "streaming", False))

    def count_tokens(self, text: str) -> int:
        return int(self.inner.count_tokens(text))

    def prompt_ids(self, text: str) -> list[int] | None:
        ids: list[int] | None = self.inner.prompt_ids(text)
        return ids

    def infer(self, inputs: Sequence[EngineInput]) -> list[Outcome]:
        return list(self.inner.infer(inputs))

    def add(self, key: int, inp: EngineInput) -> Failure | None:
        failure: Failure | None = self.inner.add(key, inp)
        return failure

    def step(self) -> list[tuple[int, Outcome]]:
        return list(self.inner.step())

    def running(self) -> int:
        return int(self.inner.running())

    def abort(self, keys: Iterable[int] | None = None) -> list[int]:
        return list(self.inner.abort(keys))

    def close(self) -> None:
        self.inner.abort()  # the next worker starts with an empty running batch


def run_worker(cfg: JobConfig, kafka: KafkaSettings, engine: Any = None, idle_exit_s: float = 4) -> None:
    """A worker in this process until its topics are idle; with no engine given it starts (and stops) its own."""
    from consumers.engines.vllm import VLLMEngine
    from consumers.worker import Worker

    Worker(cfg, kafka, engine=SharedEngine(engine) if engine else VLLMEngine(cfg), idle_exit_s=idle_exit_s).run()
