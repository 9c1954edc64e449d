"""``batchline api`` in the background, and the official OpenAI SDK pointed at it (the client batch users have)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from openai import OpenAI

from tests.support.kafka import wait_for
from tests.support.probes import free_port, get
from tests.support.procs import CliProcess

READY_TIMEOUT_S = 60.0
KEYS = {"acme": "sk-acme-0123456789", "globex": "sk-globex-9876543210"}
KEYS_ENV = ",".join(f"{tenant}:{key}" for tenant, key in KEYS.items())


class ApiServer:
    """One ``batchline api`` replica serving ``models`` ({name: job}) with each job's config."""

    def __init__(
        self,
        bootstrap: str,
        log_path: Path,
        models: dict[str, str],
        configs: dict[str, Path],
        prefix: str,
        port: int | None = None,
        options: list[str] | None = None,
    ) -> None:
        """``options``: more ``batchline api`` options (``--tenant-max-requests 100``)."""
        self.port = port or free_port()
        args = ["api", "--port", str(self.port), "--host", "127.0.0.1", "--topic-prefix", prefix, *(options or [])]
        for name, job in models.items():
            args += ["--model", f"{name}={job}"]
        for job, path in configs.items():
            args += ["--config", f"{job}={path}"]
        self.proc = CliProcess(args, bootstrap, log_path, env={"BATCHLINE_API_KEYS": KEYS_ENV})
        self.clients: list[OpenAI] = []

    def start(self) -> ApiServer:
        self.proc.start()
        wait_for(lambda: self.ready() or not self.proc.alive(), READY_TIMEOUT_S, f"api on {self.port} ready")
        assert self.proc.alive(), f"batchline api exited:\n{self.proc.log()}"
        return self

    def ready(self) -> bool:
        return get(self.port, "/readyz")[0] == 200

    def client(self, tenant: str = "acme", key: str | None = None) -> OpenAI:
        """An SDK client of this replica (closed when the replica stops)."""
        client = OpenAI(
            base_url=f"http://127.0.0.1:{self.port}/v1", api_key=key or KEYS[tenant], max_retries=0, timeout=120
        )
        self.clients.append(client)
        return client

    def stop(self) -> None:
        for client in self.clients:
            client.close()
        self.proc.stop()

    def __enter__(self) -> ApiServer:
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()


def batch_lines(n: int, model: str, endpoint: str = "/v1/chat/completions", prefix: str = "task") -> list[str]:
    """``n`` OpenAI batch input lines for ``endpoint``, custom ids ``{prefix}-00000``..."""
    out = []
    for i in range(n):
        text = f"summarise ticket {i} about order {i * 7}"
        body: dict[str, Any]
        if endpoint == "/v1/chat/completions":
            body = {"model": model, "messages": [{"role": "user", "content": text}], "max_tokens": 16}
        elif endpoint == "/v1/completions":
            body = {"model": model, "prompt": text, "max_tokens": 16}
        else:
            body = {"model": model, "input": text}
        out.append(json.dumps({"custom_id": f"{prefix}-{i:05d}", "method": "POST", "url": endpoint, "body": body}))
    return out


def write_lines(path: Path, lines: list[str]) -> Path:
    path.write_text("".join(line + "\n" for line in lines))
    return path


def wait_batch(client: OpenAI, batch_id: str, statuses: set[str], timeout: float) -> Any:
    """Poll the batch until its status is one of ``statuses``; returns it."""

    def reached() -> Any:
        batch = client.batches.retrieve(batch_id)
        return batch if batch.status in statuses else None

    return wait_for(reached, timeout, f"batch {batch_id} in {statuses}", interval=0.5)


def jsonl(text: str) -> list[dict[str, Any]]:
    return [json.loads(line) for line in text.splitlines() if line.strip()]


def rss_kb(pid: int, field: str = "VmHWM") -> int:
    """A memory figure of the process from /proc (``VmHWM``: peak resident set; ``VmRSS``: now), in KiB."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(f"{field}:"):
            return int(line.split()[1])
    raise AssertionError(f"no {field} for pid {pid}")


def round_trip_rss(api: ApiServer, model: str, n: int, tmp: Path, timeout: float) -> dict[str, Any]:
    """Upload an ``n``-line file to a fresh replica, run it as a batch, download its output to disk (streamed);
    the replica's resident memory at start and at its peak (MiB) and the lines that came back."""
    assert api.proc.proc is not None
    pid = api.proc.proc.pid
    started_kb = rss_kb(pid, "VmRSS")
    client = api.client()
    src = write_lines(tmp / f"in-{n}.jsonl", batch_lines(n, model))
    with src.open("rb") as fh:
        file_id = client.files.create(file=fh, purpose="batch").id
    uploaded_kb = rss_kb(pid)
    batch = client.batches.create(input_file_id=file_id, endpoint="/v1/chat/completions", completion_window="24h")
    created_kb = rss_kb(pid)
    done = wait_batch(client, batch.id, {"completed"}, timeout)
    finished_kb = rss_kb(pid)
    out, lines = tmp / f"out-{n}.jsonl", 0
    with client.files.with_streaming_response.content(done.output_file_id) as resp, out.open("wb") as fh:
        for chunk in resp.iter_bytes():
            fh.write(chunk)
            lines += chunk.count(b"\n")
    return {
        "lines": n,
        "input_mb": round(src.stat().st_size / 2**20, 2),
        "output_lines": lines,
        "start_rss_mb": round(started_kb / 1024, 1),
        "peak_rss_mb": round(rss_kb(pid) / 1024, 1),
        "peak_after_upload_mb": round(uploaded_kb / 1024, 1),
        "peak_after_create_mb": round(created_kb / 1024, 1),
        "peak_before_download_mb": round(finished_kb / 1024, 1),
    }
