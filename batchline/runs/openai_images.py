"""Image parts of OpenAI batch lines: chat's ``image_url`` parts and the Responses API's ``input_image`` parts,
turned into the Request's image parts (``schemas.models.ContentPart``: a data URL, ``detail`` auto).

What is checked here is what the line says (a data URL, a detail batchline honours); whether the image itself is
one a worker may pass on (its size, its pixels, whether it decodes) is checked by the worker, which ends a bad one
as a failed line naming the part (``schemas.images``).
"""

from __future__ import annotations

from typing import Any

from batchline.runs.openai_convert import invalid, unsupported
from schemas.images import DETAILS

REMOTE = ("http://", "https://")


def chat_image(part: dict[str, Any], where: str) -> dict[str, Any]:
    """``{"type": "image_url", "image_url": {"url": ..., "detail": ...}}`` (or ``"image_url": "<url>"``)."""
    for key, item in part.items():
        if key not in ("type", "image_url") and item is not None:
            raise unsupported(f"{where}.{key}", "is not carried: an image_url part is its image_url")
    inner = part.get("image_url")
    if isinstance(inner, str):
        inner = {"url": inner}
    if not isinstance(inner, dict):
        raise invalid(f"{where}.image_url", "must be an object with url")
    for key, item in inner.items():
        if key not in ("url", "detail") and item is not None:
            raise unsupported(f"{where}.image_url.{key}", "is not carried: an image_url is its url and detail")
    return _part(inner.get("url"), inner.get("detail"), f"{where}.image_url")


def input_image(part: dict[str, Any], where: str) -> dict[str, Any]:
    """The Responses API's ``{"type": "input_image", "image_url": ..., "detail": ...}``; ``file_id`` is refused."""
    if part.get("file_id") is not None:
        raise unsupported(f"{where}.file_id", "images by file id are not served: give image_url as a data URL")
    for key, item in part.items():
        if key not in ("type", "image_url", "detail", "file_id") and item is not None:
            raise unsupported(f"{where}.{key}", "is not carried: an input_image part is its image_url and detail")
    return _part(part.get("image_url"), part.get("detail"), where)


def _part(url: Any, detail: Any, where: str) -> dict[str, Any]:
    if not isinstance(url, str) or not url:
        raise invalid(f"{where}{'.url' if where.endswith('image_url') else '.image_url'}", "must be a string")
    field = f"{where}.url" if where.endswith("image_url") else f"{where}.image_url"
    if url.lower().startswith(REMOTE):
        raise unsupported(field, "remote image URLs are not fetched by workers: give the image as a data URL")
    if not url.startswith("data:"):
        raise invalid(field, "must be a data URL (data:image/png;base64,...)")
    if detail not in DETAILS:
        raise unsupported(
            f"{where}.detail", f"{detail!r} is not honoured (the model's processor sets the resolution): auto"
        )
    return {"type": "image_url", "image_url": {"url": url, **({"detail": detail} if detail else {})}}
