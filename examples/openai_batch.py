"""The OpenAI Batch API workflow against ``batchline api``, with nothing but the official ``openai`` SDK.

Uploads a batch input file, creates a batch from it and polls it to the end, creates a second batch and cancels
it, then downloads both batches' output and error files. Guarantees (batchline's): every request of a batch comes
back exactly once, by ``custom_id``, in the output file (a result) or the error file (a dead letter, or
``batch_cancelled`` / ``batch_expired`` for requests a cancel or the completion window stopped before they ran);
``request_counts.completed + failed == total`` once a batch has ended. Any replica of the API answers alike.

    python examples/openai_batch.py --base-url http://localhost:8000/v1 --api-key sk-demo-local \\
        --model demo-classifier [--requests 200]
"""

from __future__ import annotations

import argparse
import io
import json
import os
import time

from openai import ConflictError, OpenAI

DONE = {"completed", "failed", "expired", "cancelled"}


def input_file(model: str, n: int, tag: str) -> bytes:
    lines = (
        {
            "custom_id": f"{tag}-{i}",
            "method": "POST",
            "url": "/v1/chat/completions",
            "body": {"model": model, "messages": [{"role": "user", "content": f"Ticket {i}: my parcel is late"}]},
        }
        for i in range(n)
    )
    return "".join(json.dumps(line) + "\n" for line in lines).encode()


def poll(client: OpenAI, batch_id: str, timeout: float) -> object:
    deadline = time.monotonic() + timeout
    while True:
        batch = client.batches.retrieve(batch_id)
        if batch.status in DONE or time.monotonic() > deadline:
            return batch
        time.sleep(1)


def download(client: OpenAI, file_id: str | None) -> list[dict[str, object]]:
    if file_id is None:
        return []
    return [json.loads(line) for line in client.files.content(file_id).text.splitlines() if line]


def error_code(line: dict[str, object]) -> str:
    """An error line's code: a request that ran and failed carries it in its response's error body (status 400 or
    500), one that never ran (``batch_cancelled``, ``batch_expired``) in ``error``, as OpenAI writes them."""
    error = line["error"] or line["response"]["body"]["error"]  # type: ignore[index]
    return str(error["code"])  # type: ignore[index]


def report(client: OpenAI, name: str, batch: object) -> None:
    output, errors = download(client, batch.output_file_id), download(client, batch.error_file_id)  # type: ignore[attr-defined]
    counts = batch.request_counts  # type: ignore[attr-defined]
    codes = sorted({error_code(e) for e in errors})
    print(f"{name} {batch.status}: {counts.completed} completed, {counts.failed} failed of {counts.total}; "  # type: ignore[attr-defined]
          f"output file {len(output)} lines, error file {len(errors)} lines {codes}")  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base-url", default=os.environ.get("OPENAI_BASE_URL", "http://localhost:8000/v1"))
    parser.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY", "sk-demo-local"))
    parser.add_argument("--model", default="demo-classifier")
    parser.add_argument("--requests", type=int, default=200)
    parser.add_argument("--timeout", type=float, default=600.0)
    args = parser.parse_args()
    client = OpenAI(base_url=args.base_url, api_key=args.api_key)

    upload = client.files.create(file=("tickets.jsonl", io.BytesIO(input_file(args.model, args.requests, "t"))),
                                 purpose="batch")  # fmt: skip
    print(f"uploaded {upload.id} ({upload.bytes} bytes)")
    batch = client.batches.create(input_file_id=upload.id, endpoint="/v1/chat/completions", completion_window="24h")
    print(f"created {batch.id}: {batch.status}")

    second = client.batches.create(input_file_id=upload.id, endpoint="/v1/chat/completions", completion_window="24h")
    try:
        print(f"cancel {second.id}: {client.batches.cancel(second.id).status}")
    except ConflictError as exc:  # it ended before the cancel arrived
        print(f"cancel {second.id}: too late ({exc.message})")

    report(client, "batch", poll(client, batch.id, args.timeout))
    report(client, "cancelled batch", poll(client, second.id, args.timeout))
    client.close()


if __name__ == "__main__":
    main()
