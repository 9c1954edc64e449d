"""Read a process's probe port the way Kubernetes and Prometheus do: HTTP GET, Prometheus text parsed by
``prometheus_client``'s own parser (not ours)."""

from __future__ import annotations

import socket
import urllib.error
import urllib.request
from collections.abc import Mapping

from prometheus_client.parser import text_string_to_metric_families

GET_TIMEOUT_S = 10.0
Samples = list[tuple[str, dict[str, str], float]]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def get(port: int, path: str) -> tuple[int, str]:
    """(status, body) of ``GET http://127.0.0.1:port/path``; (0, why) while nothing listens."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=GET_TIMEOUT_S) as resp:
            return resp.status, resp.read().decode()
    except urllib.error.HTTPError as err:
        return err.code, err.read().decode()
    except (urllib.error.URLError, ConnectionError, TimeoutError) as err:
        return 0, str(err)


def scrape(port: int) -> Samples:
    """Every sample of ``/metrics`` as (name, labels, value)."""
    status, body = get(port, "/metrics")
    assert status == 200, f"/metrics answered {status}: {body[:300]}"
    return [
        (s.name, dict(s.labels), s.value) for family in text_string_to_metric_families(body) for s in family.samples
    ]


def values(samples: Samples, name: str, **labels: str) -> list[float]:
    """The values of ``name`` whose labels include ``labels``."""
    return [v for n, lab, v in samples if n == name and _includes(lab, labels)]


def total(samples: Samples, name: str, **labels: str) -> float:
    return sum(values(samples, name, **labels))


def by_label(samples: Samples, name: str, label: str, **labels: str) -> dict[str, float]:
    """``name``'s values keyed by one label (summed over the others)."""
    out: dict[str, float] = {}
    for n, lab, v in samples:
        if n == name and _includes(lab, labels):
            out[lab.get(label, "")] = out.get(lab.get(label, ""), 0.0) + v
    return out


def _includes(labels: Mapping[str, str], wanted: Mapping[str, str]) -> bool:
    return all(labels.get(k) == v for k, v in wanted.items())
