"""docs/architecture.md read as data: its tables, its backticked names, and which of our modules a name stands for.

The record-path test (tests/integration/test_record_path.py) and the thread-table test
(tests/integration/test_thread_table.py) hold the doc to a running worker with these.
"""

from __future__ import annotations

import ast
import re
from functools import cache
from pathlib import Path

ROOT = Path(__file__).parents[2]
DOC = ROOT / "docs" / "architecture.md"
PACKAGES = ("batchline", "consumers", "streams", "schemas")


def section(heading: str) -> str:
    """The text under ``heading`` up to the next heading of any level (its subsections are sections of their own)."""
    text = DOC.read_text()
    start = text.index(heading)
    rest = text[start + len(heading) :]
    end = re.search(r"^#+ ", rest, re.M)
    return heading + (rest[: end.start()] if end else rest)


def table(heading: str) -> list[list[str]]:
    """The rows (cells) of the first table after ``heading``, past its header and rule."""
    rows = []
    for line in section(heading).splitlines()[1:]:
        if line.startswith("|"):
            rows.append([cell.strip() for cell in line.strip().strip("|").split("|")])
        elif rows:
            break
    return rows[2:]


def backticked(text: str) -> list[str]:
    return re.findall(r"`([^`]+)`", text)


def module_of_path(path: str) -> str | None:
    """``consumers/intake.py`` -> ``consumers.intake``, for a file of ours that exists; else None."""
    rel = Path(path)
    if rel.suffix != ".py" or not rel.parts or rel.parts[0] not in PACKAGES or not (ROOT / rel).is_file():
        return None
    parts = list(rel.with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


class CodeIndex:
    """Where each top-level name and each ``Class.member`` of our packages is defined (dotted modules)."""

    def __init__(self) -> None:
        self.names: dict[str, set[str]] = {}  # top-level function, class or constant -> modules defining it
        self.members: dict[str, set[str]] = {}  # Class.method / Class.field -> modules
        self.modules: set[str] = set()
        for package in PACKAGES:
            for path in (ROOT / package).rglob("*.py"):
                module = module_of_path(str(path.relative_to(ROOT)))
                assert module is not None
                self.modules.add(module)
                for node in ast.parse(path.read_text()).body:
                    for name in _defined(node):
                        self.names.setdefault(name, set()).add(module)
                    if isinstance(node, ast.ClassDef):
                        for item in node.body:
                            for member in _defined(item):
                                self.members.setdefault(f"{node.name}.{member}", set()).add(module)

    def modules_named(self, token: str) -> set[str]:
        """The modules a backticked token of the doc stands for: a path, a dotted module (or a name in one), a
        ``Class.member``, or a top-level name. Empty for anything else (a setting, a librdkafka call, a word)."""
        token = token.strip().rstrip("()")
        if token.endswith(".py"):
            module = module_of_path(token)
            return {module} if module else set()
        if token in self.members:
            return set(self.members[token])
        if token in self.names:
            return set(self.names[token])
        parts = token.split(".")
        for n in range(len(parts), 0, -1):  # schemas.codec.decode_request -> schemas.codec
            if ".".join(parts[:n]) in self.modules:
                return {".".join(parts[:n])}
        return set()


def _defined(node: ast.stmt) -> list[str]:
    if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
        return [node.name]
    if isinstance(node, ast.Assign):
        return [t.id for t in node.targets if isinstance(t, ast.Name)]
    if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
        return [node.target.id]
    return []


@cache
def code_index() -> CodeIndex:
    return CodeIndex()
