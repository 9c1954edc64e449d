"""The Apache Avro Java reference implementation, driven through ``examples/java/BatchlineAvro.java``.

Compiled with ``javac`` against the jars Debian's ``libavro-java`` installs (or ``BATCHLINE_TEST_AVRO_CLASSPATH``).
Where ``java``/``javac`` or the jars are missing, :func:`compile_reference` says why, and the tests skip with it.
"""

from __future__ import annotations

import base64
import json
import os
import shutil
import subprocess
from collections.abc import Iterable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).parents[2]
SOURCE = ROOT / "examples" / "java" / "BatchlineAvro.java"
SCHEMAS = ROOT / "schemas"
JARS_DIR = Path("/usr/share/java")
# avro.jar and what its classes load on this path (Debian package names in the comments).
REQUIRED_JARS = (
    "avro.jar",  # libavro-java
    "jackson-core-asl.jar",  # libjackson-json-java
    "jackson-mapper-asl.jar",
    "paranamer.jar",  # libparanamer-java
    "commons-compress.jar",  # libcommons-compress-java
    "slf4j-api.jar",  # libslf4j-java
)
OPTIONAL_JARS = ("avro-guava-dependencies.jar", "xz.jar", "snappy-java.jar", "joda-time.jar", "slf4j-nop.jar")
INSTALL_HINT = "apt-get install default-jdk-headless libavro-java"
COMPILE_TIMEOUT_S = 120.0
RUN_TIMEOUT_S = 60.0


class ReferenceAvro:
    """The compiled reference program: ``decode`` reads batchline's records, ``requests`` writes Requests."""

    def __init__(self, classes: Path, classpath: str) -> None:
        self.classpath = f"{classes}{os.pathsep}{classpath}"

    def _run(self, mode: str, lines: Iterable[str]) -> list[str]:
        proc = subprocess.run(
            ["java", "-cp", self.classpath, "BatchlineAvro", mode, str(SCHEMAS)],
            input="".join(f"{line}\n" for line in lines),
            capture_output=True,
            text=True,
            encoding="utf-8",
            timeout=RUN_TIMEOUT_S,
            check=False,
        )
        assert proc.returncode == 0, f"BatchlineAvro {mode} failed:\n{proc.stderr}"
        return proc.stdout.splitlines()

    def decode(self, records: list[tuple[str, bytes]]) -> list[dict[str, Any]]:
        """What the reference decoder reads from each (kind, bytes): header, record, reencoded | error."""
        out = self._run("decode", (f"{kind} {base64.b64encode(data).decode()}" for kind, data in records))
        assert len(out) == len(records), out
        return [json.loads(line) for line in out]

    def encode_requests(self, prompts: dict[str, str]) -> dict[str, bytes]:
        """Single-object Requests written by the reference encoder, by id."""
        out = self._run("requests", (f"{rid}\t{prompt}" for rid, prompt in prompts.items()))
        return {rid: base64.b64decode(line) for rid, line in zip(prompts, out, strict=True)}


def classpath() -> tuple[str | None, str]:
    """The jar classpath, or None and the reason it cannot be built here."""
    explicit = os.environ.get("BATCHLINE_TEST_AVRO_CLASSPATH")
    if explicit:
        return explicit, ""
    missing = [jar for jar in REQUIRED_JARS if not (JARS_DIR / jar).is_file()]
    if missing:
        return None, f"Apache Avro's Java jars not in {JARS_DIR} (missing {', '.join(missing)}): {INSTALL_HINT}"
    jars = [*REQUIRED_JARS, *(j for j in OPTIONAL_JARS if (JARS_DIR / j).is_file())]
    return os.pathsep.join(str(JARS_DIR / jar) for jar in jars), ""


def compile_reference(out: Path) -> tuple[ReferenceAvro | None, str]:
    """``javac`` the example into ``out``; (None, why) where the JDK or the jars are absent."""
    if not (shutil.which("java") and shutil.which("javac")):
        return None, f"java/javac not on PATH: {INSTALL_HINT}"
    jars, why = classpath()
    if jars is None:
        return None, why
    proc = subprocess.run(
        ["javac", "-encoding", "UTF-8", "-d", str(out), "-cp", jars, str(SOURCE)],
        capture_output=True,
        text=True,
        timeout=COMPILE_TIMEOUT_S,
        check=False,
    )
    assert proc.returncode == 0, f"javac {SOURCE.name} failed:\n{proc.stderr}"
    return ReferenceAvro(out, jars), ""
