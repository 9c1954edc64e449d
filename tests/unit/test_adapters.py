"""The adapter book (consumers/engines/adapters.py) on adapters made with ``peft`` on the tiny Llama: digests per
version, a directory read again for new names, the refusals (unknown, corrupt, rank over the limit, another base
model) as ``invalid_input`` failures naming ``adapter``, and a pinned version kept after its source changed."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from batchline.config import LoraConfig
from consumers.engines.adapters import Adapter, AdapterBook
from consumers.work import Failure
from tests.support.adapters import build_adapter, corrupt_adapter, with_rank
from tests.support.models import build_tiny_llama

pytest.importorskip("peft")


@pytest.fixture(scope="module")
def made(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("adapters")
    base = build_tiny_llama(root / "tiny-llama")
    other = build_tiny_llama(root / "narrow-llama", hidden=128)
    a = build_adapter(base, root / "made" / "a", seed=1)
    return {
        "base": base,
        "a": a,
        "b": build_adapter(base, root / "made" / "b", seed=2),
        "a2": build_adapter(base, root / "made" / "a2", seed=3),
        "corrupt": corrupt_adapter(a, root / "made" / "corrupt"),
        "wide": with_rank(a, root / "made" / "wide", 64),
        "narrow": build_adapter(other, root / "made" / "narrow", seed=4),
    }


def _book(made: dict[str, Path], tmp_path: Path, **lora: object) -> AdapterBook:
    config = LoraConfig.model_validate({"store": str(tmp_path / "store"), "rescan_s": 0, **lora})
    return AdapterBook(config, max_rank=16, base_model=str(made["base"]))


def _ok(found: Adapter | Failure) -> Adapter:
    assert isinstance(found, Adapter), found
    return found


def _refused(found: Adapter | Failure, error_type: str) -> str:
    assert isinstance(found, Failure), found
    assert found.failure_class == "invalid_input" and found.error_type == error_type, found
    assert found.message.startswith("adapter: "), found.message
    return found.message


def test_each_adapter_has_its_own_digest_and_a_stable_one(made: dict[str, Path], tmp_path: Path) -> None:
    book = _book(made, tmp_path, adapters={"a": str(made["a"]), "b": str(made["b"])})
    a, b = _ok(book.resolve("a")), _ok(book.resolve("b"))
    assert a.digest != b.digest and a.lora_id != b.lora_id and a.rank == b.rank == 8
    assert _ok(book.resolve("a")) == a  # nothing changed: the same version
    again = _book(made, tmp_path / "again", adapters={"a": str(made["a"])})
    assert _ok(again.resolve("a")).digest == a.digest  # a digest of the files, not of the worker
    assert (Path(a.path) / "adapter_config.json").read_bytes() == (made["a"] / "adapter_config.json").read_bytes()


def test_a_directory_is_read_again_for_a_name_not_known_yet(made: dict[str, Path], tmp_path: Path) -> None:
    root = tmp_path / "adapters"
    shutil.copytree(made["a"], root / "a")
    book = _book(made, tmp_path, directory=str(root))
    assert book.names() == ["a"]
    message = _refused(book.resolve("b"), "UnknownAdapter")
    assert "'b'" in message and "known: a" in message
    shutil.copytree(made["b"], root / "b")  # added while the worker runs
    assert _ok(book.resolve("b")).name == "b"


@pytest.mark.parametrize(
    ("which", "error_type", "reason"),
    [
        ("corrupt", "AdapterLoadFailed", "unreadable weights"),
        ("wide", "AdapterRankTooLarge", "rank 64 > max_lora_rank 16"),
        ("narrow", "AdapterBaseMismatch", "made for another base model"),
    ],
)
def test_an_adapter_that_cannot_load_is_refused_with_its_reason(
    made: dict[str, Path], tmp_path: Path, which: str, error_type: str, reason: str
) -> None:
    book = _book(made, tmp_path, adapters={"x": str(made[which]), "a": str(made["a"])})
    assert reason in _refused(book.resolve("x"), error_type)
    assert _ok(book.resolve("a")).name == "a"  # the others are served


def test_a_missing_directory_is_refused(made: dict[str, Path], tmp_path: Path) -> None:
    book = _book(made, tmp_path, adapters={"gone": str(tmp_path / "nowhere")})
    assert "has no adapter_config.json" in _refused(book.resolve("gone"), "AdapterLoadFailed")


def test_a_retrained_adapter_is_a_new_version_and_the_old_one_is_kept(made: dict[str, Path], tmp_path: Path) -> None:
    source = tmp_path / "src" / "a"
    shutil.copytree(made["a"], source)
    book = _book(made, tmp_path, adapters={"a": str(source)})
    old = _ok(book.resolve("a"))
    shutil.copy(made["a2"] / "adapter_model.safetensors", source / "adapter_model.safetensors")  # retrained
    new = _ok(book.resolve("a"))
    assert new.digest != old.digest and new.lora_id != old.lora_id
    kept = book.version("a", old.digest)
    assert kept == old
    assert (Path(old.path) / "adapter_model.safetensors").read_bytes() == (
        made["a"] / "adapter_model.safetensors"
    ).read_bytes()
    # a persistent store keeps both versions for the next worker on this host
    later = _book(made, tmp_path, adapters={"a": str(source)})
    assert {v.digest for v in (later.version("a", old.digest), later.version("a", new.digest)) if v} == {
        old.digest,
        new.digest,
    }


def test_the_zero_adapter_has_the_adapters_tensors_all_zero(made: dict[str, Path], tmp_path: Path) -> None:
    """What base-model records run with on vLLM's CPU build once adapters are loaded (consumers/engines/vllm_lora.py):
    the same config and tensor names, shapes and dtypes, every value zero, readable by safetensors."""
    from safetensors.torch import load_file

    from consumers.engines.vllm_lora import make_zero_adapter

    zero = make_zero_adapter(made["a"], tmp_path / "zero")
    ours, theirs = load_file(zero / "adapter_model.safetensors"), load_file(made["a"] / "adapter_model.safetensors")
    assert ours.keys() == theirs.keys() and ours
    for name, tensor in ours.items():
        assert tensor.shape == theirs[name].shape and tensor.dtype == theirs[name].dtype
        assert not tensor.any() and theirs[name].any()
    assert (zero / "adapter_config.json").read_text() == (made["a"] / "adapter_config.json").read_text()
