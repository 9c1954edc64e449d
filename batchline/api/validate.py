"""Validation of a batch input file, and its lines turned into batchline Requests.

A file passes when every non-blank line is a JSON object with a ``custom_id`` (a string, unique in the file),
``method`` ``POST``, ``url`` equal to the batch's endpoint, and a ``body`` that converts to a Request for that
endpoint (every field by its rule in :mod:`batchline.runs.openai_fields`: honoured, or the line fails naming it)
with the same ``model`` as the other lines, a model this server routes. An embeddings batch has one
``encoding_format``, the first line's. Every failing line is named (``line``, 1-based, and the field as ``param``)
as OpenAI names them; the first :data:`MAX_ERRORS` are kept. A file that passes is published whole; one that fails
publishes nothing (the batch is ``failed``).

The custom ids seen are kept in a SQLite file in a temporary directory, so memory does not grow with the file.
"""

from __future__ import annotations

import json
import sqlite3
import tempfile
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from batchline.api.quota import prompt_tokens
from batchline.api.records import BatchError
from batchline.api.settings import EMBEDDINGS, ModelRoute
from batchline.runs.openai_convert import LineError, param_of
from batchline.runs.openai_fields import convert
from batchline.runs.openai_images import remote_images
from batchline.runs.request_options import refusal
from schemas import Request

MAX_ERRORS = 100
DEFAULT_ENCODING = "float"  # an embeddings line without encoding_format, as OpenAI reads it


@dataclass
class Validation:
    model: str | None = None
    count: int = 0
    errors: list[BatchError] = field(default_factory=list)
    more_errors: int = 0  # failing lines beyond MAX_ERRORS
    encoding_format: str | None = None  # an embeddings batch's: its first converted line's
    prompt_tokens: int = 0  # estimated, for the tenant's enqueued-token limit (batchline.api.quota)

    def fail(self, code: str, message: str, line: int | None = None, param: str | None = None) -> None:
        if len(self.errors) < MAX_ERRORS:
            self.errors.append(BatchError(code=code, message=message, line=line, param=param))
        else:
            self.more_errors += 1


REMOTE_REFUSED = (
    "is a remote image URL, and the model's job fetches none from there (images.fetch.allow); give the image as a "
    "data URL"
)


def to_request(custom_id: str, body: Mapping[str, Any], endpoint: str) -> dict[str, Any]:
    """The Request fields of one line's ``body`` for ``endpoint``; LineError names the field that does not fit."""
    return convert(custom_id, body, endpoint).out


class _Seen:
    def __init__(self, directory: str) -> None:
        self.db = sqlite3.connect(Path(directory) / "ids.sqlite")
        self.db.execute("PRAGMA journal_mode=OFF")
        self.db.execute("CREATE TABLE ids (id TEXT PRIMARY KEY, line INTEGER) WITHOUT ROWID")

    def first_line(self, custom_id: str, line: int) -> int | None:
        """None if ``custom_id`` is new, else the line it was first seen on."""
        row = self.db.execute("SELECT line FROM ids WHERE id = ?", (custom_id,)).fetchone()
        if row is not None:
            return int(row[0])
        self.db.execute("INSERT INTO ids VALUES (?, ?)", (custom_id, line))
        return None


def validate(lines: Iterable[tuple[int, bytes]], endpoint: str, routes: Mapping[str, ModelRoute]) -> Validation:
    """Check every line of a batch input file for ``endpoint``."""
    result = Validation()
    with tempfile.TemporaryDirectory(prefix="batchline-validate-") as tmp:
        seen = _Seen(tmp)
        try:
            for n, raw in lines:
                result.count += 1
                _check_line(n, raw, endpoint, routes, seen, result)
        finally:
            seen.db.close()
    if result.count == 0:
        result.fail("empty_file", "The input file has no requests.", param="input_file_id")
    elif result.model is not None and result.model in routes and endpoint not in routes[result.model].endpoints:
        allowed = ", ".join(routes[result.model].endpoints)
        result.fail("invalid_endpoint", f"Model {result.model} serves {allowed}, not {endpoint}.", param="endpoint")
    if result.more_errors:
        result.errors.append(BatchError(code="too_many_errors", message=f"{result.more_errors} more lines failed."))
    return result


def _check_line(
    n: int, raw: bytes, endpoint: str, routes: Mapping[str, ModelRoute], seen: _Seen, result: Validation
) -> None:
    try:
        obj = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError, RecursionError):
        result.fail("invalid_json_line", f"Line {n} is not valid JSON.", line=n)
        return
    if not isinstance(obj, dict):
        result.fail("invalid_json_line", f"Line {n} is not a JSON object.", line=n)
        return
    if rb"\ud" in raw.lower() and not _encodable(obj):
        result.fail("invalid_json_line", f"Line {n} escapes a lone surrogate (not Unicode text).", line=n)
        return
    custom_id = obj.get("custom_id")
    if not isinstance(custom_id, str) or not custom_id:
        result.fail("missing_required_parameter", f"Line {n} has no custom_id.", line=n, param="custom_id")
        return
    first = seen.first_line(custom_id, n)
    if first is not None:
        msg = f"Line {n} repeats custom_id {custom_id!r} of line {first}."
        result.fail("duplicate_custom_id", msg, line=n, param="custom_id")
        return
    if obj.get("method", "POST") != "POST":
        result.fail("invalid_method", f"Line {n}: method must be POST.", line=n, param="method")
        return
    if obj.get("url") != endpoint:
        msg = f"Line {n}: url {obj.get('url')!r} is not the batch's endpoint {endpoint}."
        result.fail("mismatched_endpoint", msg, line=n, param="url")
        return
    body = obj.get("body")
    if not isinstance(body, dict):
        result.fail("missing_required_parameter", f"Line {n} has no body object.", line=n, param="body")
        return
    if not _check_model(n, body.get("model"), routes, result):
        return
    try:
        line = convert(custom_id, body, endpoint)
    except LineError as exc:
        result.fail(exc.code, f"Line {n}: {exc.param} {exc.reason}.", line=n, param=exc.param)
        return
    route = routes.get(result.model or "")
    for param, url in remote_images(body.get("messages") or body.get("input"), _messages_param(body)):
        if route is None or not route.config.images.fetch.allows(url):
            msg = f"Line {n}: {param} {REMOTE_REFUSED}."
            result.fail("unsupported_parameter", msg, line=n, param=param)
            return
    request = Request.model_validate(line.out)
    result.prompt_tokens += prompt_tokens(request)
    if route is not None and not request.plain and (why := refusal(request, route.config)) is not None:
        path, _, reason = why.partition(": ")  # what the job cannot honour (its limits, a tool parser...)
        param = param_of(path, line.origin)
        result.fail("invalid_body", f"Line {n}: {param} {reason}.", line=n, param=param)
        return
    if endpoint == EMBEDDINGS:
        fmt = line.encoding_format or DEFAULT_ENCODING
        if result.encoding_format is None:
            result.encoding_format = fmt
        elif fmt != result.encoding_format:
            msg = f"Line {n}: body.encoding_format {fmt!r} differs from the batch's {result.encoding_format!r}."
            result.fail("mismatched_encoding_format", msg, line=n, param="body.encoding_format")


def _messages_param(body: Mapping[str, Any]) -> str:
    return "body.messages" if body.get("messages") is not None else "body.input"


def _encodable(obj: Any) -> bool:
    """Whether every string of ``obj`` is UTF-8 text: JSON lets ``\\ud800`` escape half a character, which the
    records' encoders cannot write."""
    try:
        json.dumps(obj, ensure_ascii=False).encode()
    except UnicodeEncodeError:
        return False
    return True


def _check_model(n: int, model: Any, routes: Mapping[str, ModelRoute], result: Validation) -> bool:
    """Whether the line's model is the batch's (the first line's), a model this server routes."""
    if not isinstance(model, str) or not model:
        result.fail("missing_required_parameter", f"Line {n} has no body.model.", line=n, param="body.model")
        return False
    if result.model is None:
        result.model = model
        if model not in routes:
            known = ", ".join(sorted(routes))
            result.fail("model_not_found", f"Line {n}: model {model!r} is not served here ({known}).", n, "body.model")
            return False
    elif model != result.model and (
        model not in routes or result.model not in routes or routes[model].job != routes[result.model].job
    ):  # the lines of a batch may name the base model and its adapters: one job
        msg = f"Line {n}: model {model!r} differs from the batch's model {result.model!r}."
        result.fail("mismatched_model", msg, line=n, param="body.model")
        return False
    return True


def requests(lines: Iterable[tuple[int, bytes]], endpoint: str) -> Iterator[tuple[str, dict[str, Any]]]:
    """(custom id, Request fields) of every line of a file that passed :func:`validate`."""
    for _, raw in lines:
        obj = json.loads(raw)
        yield obj["custom_id"], to_request(obj["custom_id"], obj["body"], endpoint)
