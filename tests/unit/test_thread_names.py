"""``batchline_threads`` names a process's Python threads as they are named: batchline's names whole, Python's own
numbering dropped so that short-lived threads (one per probe request) stay one series."""

from __future__ import annotations

import threading

from batchline.telemetry.feeds import thread_names


def test_threads_are_counted_by_name_without_pythons_numbering() -> None:
    release = threading.Event()
    started = [
        threading.Thread(target=release.wait, name="txn-calls g.vm-0"),
        threading.Thread(target=release.wait),  # Thread-N (wait)
        threading.Thread(target=release.wait),
    ]
    for t in started:
        t.start()
    try:
        names = thread_names()
    finally:
        release.set()
        for t in started:
            t.join()
    assert names["txn-calls g.vm-0"] == 1
    assert names["Thread (wait)"] == 2
    assert names["MainThread"] == 1
    assert not any(name.startswith("Thread-") for name in names)
