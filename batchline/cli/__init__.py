"""The ``batchline`` command line (typer + rich). Nothing below it imports it."""

from batchline.cli.app import main

__all__ = ["main"]
