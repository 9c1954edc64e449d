"""Images for the tests, made on the spot with Pillow: good ones in several colours, and a corpus of bad ones (each
with the error type and the part path it must end as)."""

from __future__ import annotations

import base64
import io
import struct
import zlib
from typing import Any

from PIL import Image

BOMB_SIDE = 20_000


def png(color: Any = "red", size: tuple[int, int] = (40, 30)) -> bytes:
    out = io.BytesIO()
    Image.new("RGB", size, color).save(out, "PNG")
    return out.getvalue()


def data_url(data: bytes, media_type: str = "image/png") -> str:
    return f"data:{media_type};base64,{base64.b64encode(data).decode()}"


def bomb_png(side: int = BOMB_SIDE) -> bytes:
    """A valid PNG header declaring ``side`` x ``side`` pixels (400 M at 20,000) in a few dozen bytes: decoding it
    would take gigabytes; only its header may be read."""

    def chunk(kind: bytes, body: bytes) -> bytes:
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))

    header = struct.pack(">IIBBBBB", side, side, 8, 2, 0, 0, 0)
    pixels = chunk(b"IDAT", zlib.compress(b"\0" * 64))
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + pixels + chunk(b"IEND", b"")


def chat(url: str, text: str = "what is in the image?", detail: str | None = None) -> list[dict[str, Any]]:
    """One user message of a text part and an image_url part (index 1)."""
    image: dict[str, Any] = {"url": url} | ({"detail": detail} if detail else {})
    return [{"role": "user", "content": [{"type": "text", "text": text}, {"type": "image_url", "image_url": image}]}]


def bad_corpus() -> dict[str, tuple[list[dict[str, Any]], str, str]]:
    """name -> (messages, error type, field path its message starts with)."""
    good = png()
    url = "messages[0].content[1].image_url.url"
    return {
        "truncated": (chat(data_url(good[: len(good) - 30])), "UndecodableImage", url),
        "wrong_mime": (chat(data_url(good, "image/jpeg")), "WrongMediaType", url),
        "not_an_image": (chat(data_url(b"plain text, not pixels")), "UndecodableImage", url),
        "bomb": (chat(data_url(bomb_png())), "ImageTooLarge", url),
        "thirty_mb": (chat("data:image/png;base64," + "A" * (40 << 20)), "ImageTooLarge", url),
        "remote": (chat("https://example.com/cat.png"), "RemoteImage", url),
        "detail_low": (chat(data_url(good), detail="low"), "UnsupportedDetail", url.replace(".url", ".detail")),
        "svg": (chat(data_url(b"<svg/>", "image/svg+xml")), "UnsupportedMediaType", url),
    }
