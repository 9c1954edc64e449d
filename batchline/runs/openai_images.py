"""Image parts of OpenAI batch lines: chat's ``image_url`` parts and the Responses API's ``input_image`` parts,
turned into the Request's image parts (``schemas.models.ContentPart``: a data URL, ``detail`` auto).

What is checked here is what the line says (a data URL or a remote URL, a detail batchline honours); whether the
image itself is one a worker may pass on (its size, its pixels, whether it decodes) is checked by the worker, which
ends a bad one as a failed line naming the part (``schemas.images``). A remote URL is carried as it is: the worker
fetches it when the job allows its prefix (``images.fetch.allow``) and refuses it by name otherwise; the Batch API
refuses the line at once when the model's job does not allow it (:func:`remote_images`, asked by
``batchline.api.validate``).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from batchline.runs.openai_convert import invalid, unsupported
from schemas.images import DETAILS, is_remote


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
    if not url.startswith("data:") and not is_remote(url):
        raise invalid(field, "must be a data URL (data:image/png;base64,...) or an http(s) URL")
    if detail not in DETAILS:
        raise unsupported(
            f"{where}.detail", f"{detail!r} is not honoured (the model's processor sets the resolution): auto"
        )
    return {"type": "image_url", "image_url": {"url": url, **({"detail": detail} if detail else {})}}


def remote_images(value: Any, param: str = "body") -> Iterator[tuple[str, str]]:
    """Each remote image URL of a line's ``body`` (chat's ``image_url`` parts, the Responses API's ``input_image``
    parts) with the body param that holds it."""
    if isinstance(value, list):
        for i, item in enumerate(value):
            yield from remote_images(item, f"{param}[{i}]")
    elif isinstance(value, dict):
        kind, inner = value.get("type"), value.get("image_url")
        if kind == "image_url" and isinstance(inner, dict):
            where, url = f"{param}.image_url.url", inner.get("url")
        elif kind in ("image_url", "input_image"):
            where, url = f"{param}.image_url", inner
        else:
            for key, item in value.items():
                if isinstance(item, list | dict):
                    yield from remote_images(item, f"{param}.{key}")
            return
        if isinstance(url, str) and is_remote(url):
            yield where, url
