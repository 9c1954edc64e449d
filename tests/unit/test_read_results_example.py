"""``examples/read_results.py`` prints the fields a record asked for beyond the one answer."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

from tests.support.records import CHOICES_RESULT, EMBEDDINGS_RESULT, SAMPLES, TOOL_RESULT

EXAMPLE = Path(__file__).parents[2] / "examples" / "read_results.py"


def _example() -> ModuleType:
    spec = importlib.util.spec_from_file_location("read_results", EXAMPLE)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_extras_name_every_choice_tool_call_logprob_and_embedding() -> None:
    extras = _example().extras
    assert extras(CHOICES_RESULT) == (
        " choice[0]='Paris'/stop/logprobs:1('Paris'=-0.250, top 'Paris'=-0.250)"
        " choice[1]='Lyon é'/length/logprobs:2('Lyon'=-1.500, top 'Paris'=-0.500)"
        " choice[2]='Nice'/stop"
    )
    assert extras(TOOL_RESULT).endswith('/stop/calls:get_weather({"city": "Zürich"})')
    assert extras(EMBEDDINGS_RESULT) == " embeddings=2x3"
    plain = SAMPLES["result"].model_copy(update={"embedding": None})
    assert extras(plain) == ""
