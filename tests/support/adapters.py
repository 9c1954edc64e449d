"""LoRA adapters for the tests, made with ``peft`` (code we did not write) on the tiny Llama of
:func:`tests.support.models.build_tiny_llama`: rank 8 on q/v/o/down projections, with random non-zero B matrices
(PEFT's default initialisation makes B zero, an adapter that changes nothing)."""

from __future__ import annotations

import json
from pathlib import Path

TARGETS = ["q_proj", "v_proj", "o_proj", "down_proj"]


def build_adapter(base: Path, out: Path, seed: int, rank: int = 8, scale: float = 0.5) -> Path:
    """A PEFT LoRA adapter of ``base`` in ``out`` whose weights come from ``seed`` (another seed: another version)."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(base)
    config = LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=TARGETS, init_lora_weights=False)
    peft_model = get_peft_model(model, config)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_" in name:  # both A and B random and large enough to move greedy decoding off the base's
                param.copy_(torch.randn(param.shape, generator=generator) * scale)
    peft_model.save_pretrained(str(out))
    return out


def corrupt_adapter(good: Path, out: Path) -> Path:
    """A copy of ``good`` whose weight file is garbage (its config intact)."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "adapter_config.json").write_text((good / "adapter_config.json").read_text())
    (out / "adapter_model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00not a safetensors header")
    return out


def with_rank(good: Path, out: Path, rank: int) -> Path:
    """A copy of ``good`` whose config claims rank ``rank`` (over the job's ``max_lora_rank``: refused)."""
    out.mkdir(parents=True, exist_ok=True)
    config = json.loads((good / "adapter_config.json").read_text())
    config["r"] = rank
    (out / "adapter_config.json").write_text(json.dumps(config))
    (out / "adapter_model.safetensors").write_bytes((good / "adapter_model.safetensors").read_bytes())
    return out
