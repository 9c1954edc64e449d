"""Chat records with image parts on vLLM: the conversation as vLLM's chat handler takes it (OpenAI's parts, images
as data URLs), rendered by the function ``LLM.chat`` renders with and added under the engine's own request id, so
the model's chat template places the images and vLLM's processor turns them into the model's inputs
(``multi_modal_data``), with image tokens counted in the prompt as vLLM counts them.

Text-only records keep the engine's own path (``TokensPrompt`` of the tokenized chat template).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from schemas import ChatMessageLike
from schemas.images import data_url, has_images


def has_image_parts(messages: Sequence[ChatMessageLike] | None) -> bool:
    return messages is not None and has_images(messages)


def conversation(messages: Sequence[ChatMessageLike]) -> list[dict[str, Any]]:
    """OpenAI chat messages: text content as it is, parts as ``text`` and ``image_url`` parts (bytes as data URLs).
    ``detail`` is not passed on: intake let through ``auto`` only, which is what vLLM does with every image."""
    out: list[dict[str, Any]] = []
    for m in messages:
        if m.parts is None:
            out.append({"role": m.role, "content": m.content})
            continue
        parts: list[dict[str, Any]] = []
        for p in m.parts:
            if p.type == "text":
                parts.append({"type": "text", "text": p.text})
            else:
                parts.append({"type": "image_url", "image_url": {"url": data_url(p)}})
        out.append({"role": m.role, "content": parts})
    return out


def add(
    llm: Any,
    request_id: str,
    messages: Sequence[ChatMessageLike],
    params: Any,
    tools: list[Any] | None,
    lora: Any = None,
) -> None:
    """Add one chat record to ``llm``'s engine under ``request_id``, its prompt rendered as ``LLM.chat`` renders it,
    with its LoRA adapter's ``LoRARequest`` (None: the base model).

    ``LLM._preprocess_chat_one`` is the function ``LLM.chat`` and ``LLM.enqueue_chat`` render with (vLLM 0.32,
    the release the ``gpu``/``cpu`` extras pin). ``enqueue_chat`` itself is not used: it returns vLLM's internal
    request id (the external one plus a random suffix) while ``LLMEngine.step`` reports the external one, and it
    numbers requests itself, so its records could not be told apart from ours in ``step``'s outputs."""
    prompt = llm._preprocess_chat_one(conversation(messages), tools=tools)
    llm.llm_engine.add_request(request_id, prompt, params, lora_request=lora)
