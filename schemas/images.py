"""Image parts of chat records: where each one is in its record, its bytes, and whether it may reach the engine.

A record's images are checked before it reaches the engine (docs/requests.md#images): its declared type, its
encoded size, the pixels its header declares (read before anything is decoded, so a decompression bomb costs a
header read), then a full decode with Pillow (a truncated or corrupt file fails here, not inside the engine's
batch). What fails ends the record alone as an ``invalid_input`` dead letter whose message starts with the part's
path (``messages[0].content[1].image_url.url: ...``). A remote URL is refused by name unless the job allows it
(``[images.fetch]``: its prefix in ``ImageLimits.fetch_allow``); an allowed one is fetched by the worker
(``consumers.fetch``) and its bytes checked here, as a data URL's are, before the record reaches the engine.

Pillow is imported on the first image checked, never at module import.
"""

from __future__ import annotations

import base64
import binascii
import io
import re
import warnings
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any
from urllib.parse import unquote, urlsplit

# What the engines accept (Pillow's names for them), as the MIME types OpenAI's image inputs take.
MEDIA_TYPES = {"image/png": "PNG", "image/jpeg": "JPEG", "image/webp": "WEBP", "image/gif": "GIF"}
REMOTE = ("http://", "https://")
DETAILS = (None, "auto")  # low / high ask for a resolution the model's processor does not take per request


@dataclass(frozen=True)
class ImageLimits:
    """Per-record bounds (the job's ``[limits]``): encoded bytes and decoded pixels of each image, images in one
    message."""

    max_bytes: int
    max_pixels: int
    max_per_message: int
    fetch_allow: tuple[str, ...] = ()  # URL prefixes whose images the worker fetches (``images.fetch.allow``)

    def fetches(self, url: str) -> bool:
        """Whether ``url`` is a remote URL the job allows to be fetched."""
        return fetch_allowed(url, self.fetch_allow)


def fetch_allowed(url: str, allow: tuple[str, ...]) -> bool:
    """Whether ``url`` is a remote URL under one of the prefixes ``allow`` (``images.fetch.allow``), with no way out
    of it."""
    return bool(allow) and is_remote(url) and url.startswith(allow) and _plain(url)


@dataclass(frozen=True)
class ImageProblem:
    """Why a record's image may not reach the engine: ``error_type`` and a message starting with the part's path."""

    error_type: str
    message: str


def image_parts(messages: Sequence[Any] | None) -> Iterator[tuple[str, Any]]:
    """Each image part of ``messages`` with its path: ``messages[i].content[j]`` (an ``image_url`` part, as a JSON
    record or an OpenAI line writes it) or ``messages[i].parts[j]`` (an ``image`` part: bytes, Avro only)."""
    for i, message in enumerate(messages or ()):
        for j, part in enumerate(message.parts or ()):
            if part.type == "image_url":
                yield f"messages[{i}].content[{j}]", part
            elif part.type == "image":
                yield f"messages[{i}].parts[{j}]", part


def is_remote(url: str) -> bool:
    return url[:8].lower().startswith(REMOTE)


def _plain(url: str) -> bool:
    """No way out of its prefix: no dot segments (``/scans/../admin``), encoded or not, no backslashes, no user part
    (a prefix is matched as text; the server would resolve these)."""
    split = urlsplit(url)
    segments = unquote(split.path).split("/")
    return "\\" not in url and "@" not in split.netloc and ".." not in segments and "." not in segments


def remote_parts(messages: Sequence[Any] | None, limits: ImageLimits) -> list[tuple[str, Any]]:
    """The image parts the worker must fetch (allowed remote URLs), with their paths."""
    return [
        (path, part) for path, part in image_parts(messages) if part.type == "image_url" and limits.fetches(part.url)
    ]


def has_images(messages: Sequence[Any] | None) -> bool:
    return any(message.parts for message in messages or ())


def encoded(part: Any) -> tuple[str, bytes]:
    """``(media type, bytes)`` of a checked image part."""
    if part.type == "image":
        return str(part.media_type), bytes(part.data)
    head, _, body = str(part.url).partition(",")
    return head[len("data:") :].split(";")[0], base64.b64decode(body, validate=True)


def data_url(part: Any) -> str:
    """The part as a ``data:`` URL (what vLLM's chat parser takes): a data URL as it is, bytes encoded."""
    if part.type == "image_url":
        return str(part.url)
    return f"data:{part.media_type};base64,{base64.b64encode(bytes(part.data)).decode()}"


def problem(messages: Sequence[Any] | None, limits: ImageLimits) -> ImageProblem | None:
    """The first reason one of the messages' images may not reach the engine, or None."""
    for i, message in enumerate(messages or ()):
        count = sum(part.type != "text" for part in message.parts or ())
        if count > limits.max_per_message:
            return ImageProblem(
                "TooManyImages",
                f"messages[{i}].content: {count} images > limits.max_images_per_message {limits.max_per_message}",
            )
    for path, part in image_parts(messages):
        found = _part_problem(path, part, limits)
        if found is not None:
            return found
    return None


def _part_problem(path: str, part: Any, limits: ImageLimits) -> ImageProblem | None:
    where = f"{path}.image_url" if part.type == "image_url" else path
    if part.detail not in DETAILS:
        return ImageProblem(
            "UnsupportedDetail",
            f"{where}.detail: {part.detail!r} is not honoured (the model's processor sets every image's resolution); "
            "use 'auto' or leave it out",
        )
    if part.type == "image":
        declared, size = str(part.media_type), len(part.data)
        field = f"{path}.data"
        if declared not in MEDIA_TYPES:
            return _media(f"{path}.media_type", declared)
    else:
        field = f"{where}.url"
        if limits.fetches(str(part.url)):
            return None  # its bytes are checked once fetched (fetched_problem)
        parsed = _parse_data_url(field, str(part.url))
        if isinstance(parsed, ImageProblem):
            return parsed
        declared, size = parsed
    if size > limits.max_bytes:
        return ImageProblem("ImageTooLarge", f"{field}: {size} bytes > limits.max_image_bytes {limits.max_bytes}")
    try:
        data = encoded(part)[1]
    except (binascii.Error, ValueError) as exc:
        return ImageProblem("UndecodableImage", f"{field}: not base64: {exc}")
    return _decoded_problem(field, declared, data, limits)


def _parse_data_url(field: str, url: str) -> tuple[str, int] | ImageProblem:
    """``(declared media type, decoded size)`` of a base64 data URL, its size told from its length alone."""
    scheme = url.split(":", 1)[0].lower() if ":" in url[:16] else ""
    if scheme in ("http", "https"):
        return ImageProblem(
            "RemoteImage",
            f"{field}: remote image URLs are fetched only from the prefixes of the job's images.fetch.allow, and "
            "none names this one; send the image as a data URL",
        )
    if scheme != "data":
        return ImageProblem("InvalidImageURL", f"{field}: not a data URL (data:image/png;base64,...)")
    head, comma, body = url.partition(",")
    params = head[len("data:") :].split(";")
    if not comma or "base64" not in params[1:]:
        return ImageProblem("InvalidImageURL", f"{field}: a data URL of an image must be base64 (;base64,)")
    if params[0].lower() not in MEDIA_TYPES:
        return _media(field, params[0])
    padding = len(body) - len(body.rstrip("="))
    return params[0].lower(), len(body) * 3 // 4 - padding


def _media(field: str, declared: str) -> ImageProblem:
    return ImageProblem(
        "UnsupportedMediaType", f"{field}: media type {declared!r} is not one of {', '.join(sorted(MEDIA_TYPES))}"
    )


def fetched_problem(field: str, declared: str, data: bytes, limits: ImageLimits) -> ImageProblem | None:
    """Why a fetched image (``declared`` its response's media type) may not reach the engine, or None: the checks
    a data URL gets."""
    if declared not in MEDIA_TYPES:
        return _media(field, declared)
    if len(data) > limits.max_bytes:
        return ImageProblem("ImageTooLarge", f"{field}: {len(data)} bytes > limits.max_image_bytes {limits.max_bytes}")
    return _decoded_problem(field, declared, data, limits)


def _decoded_problem(field: str, declared: str, data: bytes, limits: ImageLimits) -> ImageProblem | None:
    """Open the image (its header only), bound its pixels, then decode it fully."""
    from PIL import Image, UnidentifiedImageError

    try:
        with warnings.catch_warnings():
            # our own pixel bound is checked below, from the header; Pillow's warning would only repeat it
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            with Image.open(io.BytesIO(data)) as image:
                width, height = image.size
                if width * height > limits.max_pixels:
                    return _too_many_pixels(field, f"{width}x{height} = {width * height}", limits)
                if image.format != MEDIA_TYPES[declared]:
                    actual = Image.MIME.get(image.format or "", image.format)
                    return ImageProblem("WrongMediaType", f"{field}: declared {declared}, but the bytes are {actual}")
                image.load()
    except Image.DecompressionBombError as exc:  # over twice Pillow's own bound: refused before our check
        declared_pixels = re.search(r"\((\d+) pixels\)", str(exc))
        return _too_many_pixels(field, declared_pixels.group(1) if declared_pixels else "too many", limits)
    except UnidentifiedImageError:
        return ImageProblem("UndecodableImage", f"{field}: not an image Pillow can read ({declared} declared)")
    except (OSError, SyntaxError, ValueError) as exc:
        return ImageProblem("UndecodableImage", f"{field}: {type(exc).__name__}: {exc}"[:500])
    return None


def _too_many_pixels(field: str, pixels: str, limits: ImageLimits) -> ImageProblem:
    return ImageProblem("ImageTooLarge", f"{field}: {pixels} pixels > limits.max_image_pixels {limits.max_pixels}")
