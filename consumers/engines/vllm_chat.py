"""Chat records with image parts on vLLM: the conversation as vLLM's chat handler takes it (OpenAI's parts, images
as data URLs), added through ``LLM.enqueue_chat`` - the path ``LLM.chat`` takes - so the model's chat template
places the images and vLLM's processor turns them into the model's inputs (``multi_modal_data``), with image
tokens counted in the prompt as vLLM counts them.

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


def enqueue(llm: Any, messages: Sequence[ChatMessageLike], params: Any, tools: list[Any] | None) -> str:
    """Add one chat record to ``llm``'s engine as ``LLM.chat`` would; returns vLLM's request id."""
    ids: list[str] = llm.enqueue_chat(conversation(messages), params, use_tqdm=False, tools=tools)
    return ids[0]
