"""``batchline.kafka.client.take``: a reader's batch that comes back with the first message, never after waiting
out its timeout for a full batch (what confluent-kafka's ``consume(n, timeout)`` does)."""

from __future__ import annotations

from typing import Any

from batchline.kafka.client import take


class _Consumer:
    """What take() calls, recorded: a queue of messages, ``poll`` and ``consume`` over it."""

    def __init__(self, messages: list[str]) -> None:
        self.messages = list(messages)
        self.calls: list[tuple[str, int | None, float]] = []

    def poll(self, timeout: float) -> Any:
        self.calls.append(("poll", None, timeout))
        return self.messages.pop(0) if self.messages else None

    def consume(self, n: int, timeout: float) -> list[Any]:
        self.calls.append(("consume", n, timeout))
        taken, self.messages = self.messages[:n], self.messages[n:]
        return taken


def test_take_waits_only_for_the_first_message() -> None:
    consumer = _Consumer([f"m{i}" for i in range(150)])
    assert take(consumer, 100, 5.0) == [f"m{i}" for i in range(100)]  # type: ignore[arg-type]
    assert consumer.calls == [("poll", None, 5.0), ("consume", 99, 0)]
    assert take(consumer, 100, 5.0) == [f"m{i}" for i in range(100, 150)]  # type: ignore[arg-type]


def test_take_with_nothing_there_is_one_poll_and_no_batch() -> None:
    consumer = _Consumer([])
    assert take(consumer, 100, 0.2) == []  # type: ignore[arg-type]
    assert consumer.calls == [("poll", None, 0.2)]


def test_take_of_one_is_a_poll() -> None:
    consumer = _Consumer(["a", "b"])
    assert take(consumer, 1, 1.0) == ["a"]  # type: ignore[arg-type]
    assert consumer.calls == [("poll", None, 1.0)]
