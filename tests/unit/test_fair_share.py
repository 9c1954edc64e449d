"""Fair turns (streams/fair_share.py): who is admitted next, by tenant weight, then by run priority."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator

from streams.fair_share import FairShare, Flow


def _queues(held: dict[int, list[str]], taken: dict[int, int]) -> dict[int, Iterator[str]]:
    return {p: iter(runs[taken.get(p, 0) :]) for p, runs in held.items()}


def _admit(share: FairShare, held: dict[int, list[str]], room: int, flows: dict[str, Flow]) -> Counter[str]:
    """One turn of ``room`` records; the records taken are removed from ``held``. Returns records per run."""
    got = share.take(_queues(held, {}), room, flows.__getitem__)
    admitted: Counter[str] = Counter()
    for p, n in got.items():
        admitted.update(held[p][:n])
        held[p] = held[p][n:]
    return admitted


def test_a_run_alone_gets_all_the_room() -> None:
    held = {0: ["big"] * 1000}
    got = _admit(FairShare(), held, 300, {"big": Flow("")})
    assert got == {"big": 300}


def test_a_small_run_behind_a_backfill_is_admitted_on_the_next_turn() -> None:
    share = FairShare()
    flows = {"big": Flow(""), "small": Flow("")}
    held = {0: ["big"] * 10_000}
    for _ in range(20):  # the backfill alone for a while: it earns no credit against later runs
        _admit(share, held, 100, flows)
    held[5] = ["small"] * 10
    got = _admit(share, held, 100, flows)
    assert got["small"] == 10 and got["big"] == 90


def test_runs_of_one_tenant_share_equally_and_priority_doubles_a_share() -> None:
    share = FairShare(chunk=4)
    flows = {"a": Flow(""), "b": Flow(""), "c": Flow("", run_weight=2.0)}
    held = {0: ["a"] * 5000, 1: ["b"] * 5000, 2: ["c"] * 5000}
    total: Counter[str] = Counter()
    for _ in range(10):
        total += _admit(share, held, 400, flows)
    assert total["a"] == total["b"] == 1000 and total["c"] == 2000


def test_tenants_share_by_weight_whatever_their_number_of_runs() -> None:
    share = FairShare(chunk=4)
    flows = {f"x{i}": Flow("x", tenant_weight=1.0) for i in range(5)} | {"y0": Flow("y", tenant_weight=3.0)}
    held = {i: [f"x{i}"] * 5000 for i in range(5)} | {9: ["y0"] * 5000}
    total: Counter[str] = Counter()
    for _ in range(10):
        total += _admit(share, held, 400, flows)
    x = sum(n for run, n in total.items() if run.startswith("x"))
    assert (x, total["y0"]) == (1000, 3000)
    assert {total[f"x{i}"] for i in range(5)} == {200}  # within tenant x, its runs equally


def test_runs_sharing_a_partition_go_in_their_order_there() -> None:
    held = {0: ["a"] * 3 + ["b"] * 3 + ["a"] * 3}
    got = FairShare().take(_queues(held, {}), 7, {"a": Flow(""), "b": Flow("")}.__getitem__)
    assert got == {0: 7}  # a partition is FIFO: a prefix is taken, nothing overtakes in it


def test_a_tenant_coming_back_starts_level_with_those_waiting() -> None:
    share = FairShare(chunk=10)
    flows = {"a": Flow("t1"), "b": Flow("t2")}
    held = {0: ["a"] * 10_000, 1: ["b"] * 10}
    _admit(share, held, 100, flows)  # b's 10 taken, then a alone
    assert held[1] == []
    for _ in range(10):
        _admit(share, held, 100, flows)  # a alone: t2 is forgotten
    held[1] = ["b"] * 1000
    got = _admit(share, held, 100, flows)
    assert got == {"a": 50, "b": 50}  # no debt for a's time alone, no credit for b's idle time
