"""docs/architecture.md's record-path and thread tables name what the code has: every module path, class, method and
function they cite exists, and the worker's threads are the ones the code starts, no more and no fewer. A rename or a
new thread that the doc does not follow fails here."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).parents[2]
DOC = ROOT / "docs" / "architecture.md"
CODE = [ROOT / d for d in ("batchline", "consumers", "streams", "schemas")]
# The worker's side of the code: threads started here belong in the doc's thread table (the API server and the
# streams have threads of their own, described with them).
WORKER_CODE = [ROOT / "consumers", *(ROOT / "batchline" / d for d in ("kafka", "runs", "telemetry"))]


def _table(heading: str) -> list[list[str]]:
    """The rows (cells) of the first table after ``heading``."""
    text = DOC.read_text()
    start = text.index(heading)
    rows = []
    for line in text[start:].splitlines()[1:]:
        if line.startswith("|"):
            rows.append([cell.strip() for cell in line.strip("|").split("|")])
        elif rows:
            break
    return [r for r in rows[2:]]  # past the header and its rule


def _definitions() -> tuple[set[str], set[str]]:
    """Every top-level function, class and constant name, and every ``Class.method`` and ``Class.field``, in the
    library code."""
    names: set[str] = set()
    methods: set[str] = set()
    for folder in CODE:
        for path in folder.rglob("*.py"):
            for node in ast.parse(path.read_text()).body:
                if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                    names.add(node.name)
                elif isinstance(node, ast.Assign | ast.AnnAssign):  # module constants
                    targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                    names |= {t.id for t in targets if isinstance(t, ast.Name)}
                if isinstance(node, ast.ClassDef):
                    for item in node.body:
                        if isinstance(item, ast.FunctionDef | ast.AsyncFunctionDef):
                            methods.add(f"{node.name}.{item.name}")
                        elif isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name):  # fields
                            methods.add(f"{node.name}.{item.target.id}")
    return names, methods


def _missing(cells: list[str]) -> list[str]:
    """What the backticked names of ``cells`` cite that the code does not have."""
    names, methods = _definitions()
    cited = [token for cell in cells for token in re.findall(r"`([^`]+)`", cell)]
    missing = []
    for token in cited:
        for part in re.split(r"\s+(?:->|/|\+)\s+|,\s+", token):
            part = part.strip().rstrip("()")
            if part.endswith(".py"):
                if not (ROOT / part).is_file() and not any((d / part).is_file() for d in CODE):
                    missing.append(part)
            elif re.fullmatch(r"[A-Z]\w*\.\w+", part):
                if part not in methods:
                    missing.append(part)
            elif (
                re.fullmatch(r"_?[a-z]\w*|[A-Z]\w*", part)
                and part not in names
                # a bare method name continues the row's class (``Batcher.add`` / ``take``)
                and not any(m.endswith(f".{part}") for m in methods)
            ):
                missing.append(part)
    return missing


def test_the_record_path_table_cites_what_exists() -> None:
    rows = _table("## A record's path: poll to commit")
    assert len(rows) >= 10
    missing = _missing([row[2] for row in rows])
    assert missing == [], f"docs/architecture.md's record path cites what the code no longer has: {missing}"


def test_the_glossary_cites_what_exists() -> None:
    rows = _table("## Glossary")
    assert len(rows) >= 20
    missing = _missing([row[2] for row in rows])
    assert missing == [], f"docs/architecture.md's glossary cites what the code no longer has: {missing}"


def _pattern(name: str) -> str:
    """A thread name with its variable part (``<group>`` in the doc, ``{...}`` in code) as ``*``."""
    return re.sub(r"<[^>]+>|\{[^}]+\}", "*", name)


def test_the_thread_table_lists_the_threads_the_worker_starts() -> None:
    # a thread's name opens its row in backticks (the main thread's row names none)
    documented = {_pattern(m.group(1)) for row in _table("## Threads") if (m := re.match(r"`([^`]+)`", row[0]))}
    started = set()
    for folder in WORKER_CODE:
        for path in folder.rglob("*.py"):
            for match in re.finditer(r"Thread\([^)]*name=f?\"([^\"]+)\"", path.read_text()):
                started.add(_pattern(match.group(1)))
    assert started, "no thread found in the code: the pattern above no longer reads it"
    assert started - documented == set(), f"threads started but not in docs/architecture.md: {started - documented}"
    assert documented - started == set(), (
        f"threads in docs/architecture.md the code does not start: {documented - started}"
    )
