"""The README opens with the two commands; docs/configuration.md's table is the one the settings generate."""

from __future__ import annotations

from pathlib import Path

from batchline.cli.config_doc import BEGIN, END, render

ROOT = Path(__file__).parents[2]
README = ROOT / "README.md"
CONFIGURATION = ROOT / "docs" / "configuration.md"


def test_configuration_table_is_generated_from_the_settings() -> None:
    text = CONFIGURATION.read_text()
    start, end = text.index(BEGIN), text.index(END) + len(END)
    assert text[start:end] == render(), "regenerate with `batchline config-doc` and paste into docs/configuration.md"


def test_readme_opens_with_the_two_commands() -> None:
    head = README.read_text()[:1500]
    assert "make demo" in head and "make test" in head
