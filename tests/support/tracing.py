"""Which of batchline's modules each thread calls, in order: a profiler on every thread (``threading.setprofile``
for the threads started after :meth:`ModuleTrace.installed`, ``sys.setprofile`` for the caller; Python 3.11 has no
way to reach threads already running) that records a call only between :meth:`ModuleTrace.on` and
:meth:`ModuleTrace.off`. Built for tests/integration/test_record_path.py, which follows one record through a worker
run in the test process."""

from __future__ import annotations

import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from types import FrameType
from typing import Any, NamedTuple

from tests.support.doc_tables import ROOT, module_of_path


class Call(NamedTuple):
    thread: str  # the Python thread's name
    module: str  # dotted: consumers.intake
    function: str  # co_qualname: Intake.admit


def module_of(filename: str) -> str | None:
    """The dotted module of a source file of ours (under the repository root), else None."""
    try:
        rel = Path(filename).relative_to(ROOT)
    except ValueError:
        return None
    return module_of_path(str(rel))


class ModuleTrace:
    """Calls into our modules, in the order they happened across threads (list appends under the GIL)."""

    def __init__(self) -> None:
        self.calls: list[Call] = []
        self._on = False
        self._modules: dict[str, str | None] = {}  # filename -> module, cached: the profiler sees every call

    def _profile(self, frame: FrameType, event: str, arg: Any) -> None:
        if not self._on or event != "call":
            return
        filename = frame.f_code.co_filename
        module = self._modules.get(filename, "")
        if module == "":
            module = self._modules[filename] = module_of(filename)
        if module is not None:
            self.calls.append(Call(threading.current_thread().name, module, frame.f_code.co_qualname))

    @contextmanager
    def installed(self) -> Iterator[ModuleTrace]:
        """The profiler on this thread and every thread started meanwhile. A thread started inside keeps it after
        the block (it cannot be removed from outside): stop them inside; off, it records nothing."""
        threading.setprofile(self._profile)
        sys.setprofile(self._profile)
        try:
            yield self
        finally:
            self._on = False
            sys.setprofile(None)
            threading.setprofile(None)

    def on(self) -> int:
        """Start recording; returns where the recorded calls begin in :attr:`calls`."""
        self._on = True
        return len(self.calls)

    def off(self) -> int:
        """Stop recording; returns where the recorded calls end."""
        self._on = False
        return len(self.calls)
