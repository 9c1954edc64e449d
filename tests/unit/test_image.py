"""The Dockerfile held to the tree and the CLI (no Docker needed: the file is parsed).

- Every path it copies from the build context exists in the tree and is not left out by ``.dockerignore``; a
  ``COPY --from`` names an earlier stage and a path that stage's commands write.
- It builds the wheel from the packages setuptools finds (every one of them copied into the build stage) and the
  runtime stage installs that wheel with the ``gpu`` extra in one resolve, never the source folder.
- Every ``batchline`` command it runs (RUN, CMD) parses with the real CLI (those its comments mention:
  tests/unit/test_deploy.py, with compose's and the manifests').
"""

from __future__ import annotations

import fnmatch
import json
import re
import shlex
import tomllib
from dataclasses import dataclass
from pathlib import Path

import setuptools

from tests.support.cli import parse_command

ROOT = Path(__file__).resolve().parents[2]
DOCKERFILE = ROOT / "Dockerfile"
BASE_IMAGE = "python:3.11-slim"
SHELL_OPERATORS = {"&&", "||", ";", "|", "&"}


@dataclass(frozen=True)
class Instruction:
    stage: str  # the stage's name (``FROM ... AS name``), else its index
    keyword: str  # upper case: FROM, COPY, RUN, ...
    args: str  # the rest of the instruction, continuation lines joined


def _instructions(text: str) -> list[Instruction]:
    """The Dockerfile's instructions in order; comment lines are dropped (also between continuation lines, as
    Docker drops them)."""
    lines: list[str] = []
    pending = ""
    for raw in text.splitlines():
        if raw.lstrip().startswith("#") or not raw.strip():
            continue
        if raw.rstrip().endswith("\\"):
            pending += raw.rstrip()[:-1] + " "
            continue
        lines.append(pending + raw)
        pending = ""
    assert not pending, "the Dockerfile ends inside a continuation"
    out: list[Instruction] = []
    stage, stages = "", 0
    for line in lines:
        keyword, _, args = line.strip().partition(" ")
        keyword, args = keyword.upper(), args.strip()
        if keyword == "FROM":
            named = re.fullmatch(r"(\S+)(?:\s+AS\s+(\S+))?", args, re.I)
            assert named, f"FROM {args}"
            stage = named.group(2) or str(stages)
            stages += 1
        out.append(Instruction(stage, keyword, args))
    return out


INSTRUCTIONS = _instructions(DOCKERFILE.read_text())
STAGES = list(dict.fromkeys(i.stage for i in INSTRUCTIONS))
FINAL = STAGES[-1]


def _of(stage: str, keyword: str) -> list[Instruction]:
    return [i for i in INSTRUCTIONS if i.stage == stage and i.keyword == keyword]


def _copy(args: str) -> tuple[dict[str, str], list[str], str]:
    """(flags, sources, destination) of a COPY/ADD, shell or JSON form."""
    words = shlex.split(args)
    flags = {}
    while words and words[0].startswith("--"):
        key, _, value = words.pop(0)[2:].partition("=")
        flags[key] = value
    if words and words[0].startswith("["):
        words = json.loads(args[args.index("[") :])
    *sources, dest = words
    return flags, sources, dest


def _dockerignored(path: str) -> bool:
    patterns = [p.strip() for p in (ROOT / ".dockerignore").read_text().splitlines()]
    patterns = [p for p in patterns if p and not p.startswith("#")]
    parts = Path(path).parts
    prefixes = ["/".join(parts[: n + 1]) for n in range(len(parts))]
    return any(fnmatch.fnmatch(prefix, p.removeprefix("**/")) for p in patterns for prefix in prefixes)


def _commands(args: str) -> list[list[str]]:
    """The simple commands of a RUN/CMD: its JSON array, or its shell text split at the shell's operators."""
    if args.startswith("["):
        return [json.loads(args)]
    lexer = shlex.shlex(args, posix=True, punctuation_chars=True)
    lexer.whitespace_split = True
    commands: list[list[str]] = [[]]
    for token in lexer:
        if token in SHELL_OPERATORS:
            commands.append([])
        else:
            commands[-1].append(token)
    return [c for c in commands if c]


def _found_top_level_packages() -> set[str]:
    """The top-level packages the wheel holds: setuptools' discovery with the project's own settings."""
    find = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]["find"]
    found = setuptools.find_packages(str(ROOT), include=find["include"], exclude=find.get("exclude", ()))
    return {name.split(".")[0] for name in found}


def test_dockerfile_copies_only_paths_of_the_tree_the_build_context_keeps() -> None:
    copies = [i for i in INSTRUCTIONS if i.keyword in ("COPY", "ADD")]
    assert any("from" not in _copy(i.args)[0] for i in copies), "never vacuous: the image copies from the tree"
    for copy in copies:
        flags, sources, _ = _copy(copy.args)
        if "from" in flags:
            stage = flags["from"]
            assert stage in STAGES[: STAGES.index(copy.stage)], f"COPY --from={stage}: no earlier stage {stage}"
            written = " ".join(run.args for run in _of(stage, "RUN"))
            for source in sources:
                assert source in written, f"COPY --from={stage} {source}: no command of {stage} writes it"
            continue
        for source in sources:
            assert list(ROOT.glob(source.removeprefix("./"))), f"COPY {source}: no such path in the tree"
            assert not _dockerignored(source.removeprefix("./")), f"COPY {source}: .dockerignore leaves it out"


def test_dockerfile_installs_the_wheel_it_builds_with_the_gpu_extra_in_one_resolve() -> None:
    assert all(i.args.split()[0] == BASE_IMAGE for i in INSTRUCTIONS if i.keyword == "FROM")
    builds = [
        (run.stage, found.group(1))
        for run in INSTRUCTIONS
        if run.keyword == "RUN" and (found := re.search(r"\bpip wheel --no-deps\b.* -w (\S+) \.$", run.args))
    ]
    ((wheel_stage, wheels),) = builds
    assert wheel_stage != FINAL
    copied = {s.removeprefix("./").rstrip("/") for c in _of(wheel_stage, "COPY") for s in _copy(c.args)[1]}
    packages = _found_top_level_packages()
    assert packages >= {"batchline", "consumers", "streams", "schemas"} and "tests" not in packages
    assert sorted(packages - copied) == [], "packages the wheel stage does not copy"
    assert "pyproject.toml" in copied

    # The runtime copies nothing from the tree: only the wheel, which it installs with the gpu extra.
    ((flags, sources, dest),) = [_copy(c.args) for c in _of(FINAL, "COPY")]
    assert flags == {"from": wheel_stage} and sources == [wheels]
    runs = [c for run in _of(FINAL, "RUN") for c in _commands(run.args)]
    installs = [c[2:] for c in runs if c[:2] == ["pip", "install"] and "--no-deps" not in c]
    assert installs == [[f"$(echo {dest}/batchline-*.whl)[gpu]"]], installs  # one resolve
    assert [i.args for i in _of(FINAL, "ENTRYPOINT")] == ['["/usr/bin/tini", "--"]']


def test_every_batchline_command_the_dockerfile_runs_parses_with_the_cli() -> None:
    run = [c for i in INSTRUCTIONS if i.keyword in ("RUN", "CMD") for c in _commands(i.args) if c[0] == "batchline"]
    assert run, "never vacuous: the image's CMD is a batchline command"
    for argv in run:
        parse_command(argv)
