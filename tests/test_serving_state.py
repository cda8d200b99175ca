"""The served state without servers: a run of feed answers applied in one step (upserts, tombstones, the
dense part replaced, never changed under a request), an ID without a row scored with its initial
value, a bounded store leaving its absent rows to be read, and the scores equal to the module's own."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from datastream.jagged import Jagged
from services.tables.feed import DecodedChanges
from services.tables.rows import initial_rows
from serving.protocol import Batch, model_outputs
from serving.rowstore import RowStore
from serving.state import ModuleFactory, ServedState, score, signature_of
from trainers.models import build_model
from trainers.tables import plan_lookups, pool

MODEL = "dlrm?features=2&dense=3&dim=4"


def fresh(bounded: bool = False) -> tuple[ServedState, ModuleFactory]:
    spec = build_model(MODEL)
    factory = ModuleFactory(spec)
    module = factory({k: v.detach().clone() for k, v in spec.model.state_dict().items()})
    tables = {t.name: RowStore(t.dim, max_rows=8 if bounded else 0) for t in spec.tables}
    state = ServedState(module=module, tables=tables, specs={t.name: t for t in spec.tables}, position="0",
                        version="", dense_version="0", bounded=bounded)
    return state, factory


def answer(position: str, tables: dict, *, dense: dict | None = None, versions: dict | None = None,
           applied_ms: tuple[int, ...] = (1,)) -> DecodedChanges:
    full = {name: (np.asarray(ids, np.int64), np.asarray(values, np.float32).reshape(len(ids), 4),
                   np.asarray(gone, np.int64)) for name, (ids, values, gone) in tables.items()}
    return DecodedChanges(position=position, head=position, version=position,
                          applied_ms=np.asarray(applied_ms, np.int64), tables=full, dense=dense or {},
                          dense_version=position if dense else None,
                          versions={name: np.asarray(v, np.uint64) for name, v in (versions or {}).items()})


def batch(c1: list[list[int]], c2: list[list[int]]) -> Batch:
    n = len(c1)
    return Batch(x=np.arange(n * 3, dtype=np.float32).reshape(n, 3) / 10,
                 ids={"c1": Jagged.from_lists(c1), "c2": Jagged.from_lists(c2)}, n=n)


def test_a_run_of_answers_upserts_removes_and_names_the_last_position() -> None:
    state, factory = fresh()
    first = answer("1", {"c1": ([5, 6], np.ones((2, 4)), []), "c2": ([], np.zeros((0, 4)), [])},
                   versions={"c1": [1, 1]})
    second = answer("2", {"c1": ([7], np.full((1, 4), 2.0), [5]), "c2": ([9], np.full((1, 4), 3.0), [])},
                    versions={"c1": [2], "c2": [2]}, applied_ms=(10, 20))
    applied = state.apply([first, second], factory)
    assert (applied.upserts, applied.removed, applied.entries, applied.newest_applied_ms) == (4, 1, 3, 20)
    assert state.position == state.version == "2"
    ids, values, versions = state.tables["c1"].items()
    assert ids.tolist() == [6, 7] and values[:, 0].tolist() == [1.0, 2.0] and versions.tolist() == [1, 2]
    assert state.tables["c2"].items()[0].tolist() == [9]


def test_an_id_without_a_row_scores_with_its_initial_value_and_held_rows_are_used() -> None:
    state, factory = fresh()
    state.apply([answer("1", {"c1": ([5], np.full((1, 4), 0.5), []), "c2": ([], np.zeros((0, 4)), [])})], factory)
    b = batch([[5], [5, 8]], [[3], []])
    lookup = state.lookup(b)
    assert not lookup.wanted
    # a row per ID as it comes (no sort: nothing to gather gradients for)
    born = initial_rows(state.specs["c1"], np.array([8]))[0]
    assert lookup.rows["c1"].tolist() == [[0.5] * 4, [0.5] * 4, born.tolist()]
    assert np.array_equal(lookup.rows["c2"], initial_rows(state.specs["c2"], np.array([3])))
    # the scores are the module's on the rows a trainer's lookup (deduplicated) pools
    lookups = plan_lookups(state.specs, b.ids, b.n)
    rows = {"c1": np.stack([np.full(4, 0.5, np.float32), born]),
            "c2": initial_rows(state.specs["c2"], np.array([3]))}
    pooled, _ = pool(lookups, rows, torch.device("cpu"))
    with torch.no_grad():
        want = state.module(torch.from_numpy(b.x), pooled).numpy()
    got = score(lookup)
    assert np.allclose(got, want, rtol=0, atol=1e-6)
    sig = signature_of(build_model(MODEL), "j", max_records=16)
    out = model_outputs(sig, got)
    assert np.allclose(out["probability"], 1 / (1 + np.exp(-want)), atol=1e-6)


def test_a_new_dense_part_replaces_the_module_a_request_in_flight_keeps_the_old_one() -> None:
    state, factory = fresh()
    lookup = state.lookup(batch([[1]], [[2]]))
    before = score(lookup)
    old = state.module
    zeros = {k: np.zeros(tuple(v.shape), np.float32) for k, v in old.state_dict().items()}
    applied = state.apply([answer("3", {}, dense=zeros)], factory)
    assert applied.dense and state.module is not old and state.dense_version == "3"
    assert np.array_equal(score(lookup), before)  # gathered before the swap: the module it was read with
    assert all(float(p.abs().sum()) == 0 for p in state.module.parameters())
    assert np.array_equal(score(state.lookup(batch([[1]], [[2]]))), np.zeros(1, np.float32))


def test_an_older_row_never_overwrites_a_newer_one() -> None:
    state, factory = fresh()
    state.apply([answer("1", {"c1": ([5], np.full((1, 4), 9.0), [])}, versions={"c1": [7]})], factory)
    state.apply([answer("2", {"c1": ([5], np.full((1, 4), 1.0), [])}, versions={"c1": [6]})], factory)
    assert state.tables["c1"].items()[1][0, 0] == 9.0


def test_a_bounded_store_leaves_its_absent_rows_to_be_read_and_keeps_them() -> None:
    state, factory = fresh(bounded=True)
    # the feed updates rows held, never adds rows to a bounded store
    state.apply([answer("1", {"c1": ([5], np.ones((1, 4)), []), "c2": ([], np.zeros((0, 4)), [])})], factory)
    assert state.tables["c1"].rows == 0
    lookup = state.lookup(batch([[6, 5, 6]], [[]]))  # an ID twice: read once
    assert lookup.wanted_ids()["c1"].tolist() == [5, 6] and "c2" not in lookup.wanted
    read = np.arange(8, dtype=np.float32).reshape(2, 4)
    lookup.fill("c1", np.array([5, 6]), read)
    assert np.array_equal(lookup.rows["c1"], read[[1, 0, 1]])
    # 6 has no row in the plane (its initial value was read): not kept, so the store never holds a row
    # the plane lacks
    state.insert_read("c1", np.array([5, 6]), read, np.array([3, 0], np.uint64), np.array([True, False]))
    assert state.misses == 2 and state.tables["c1"].items()[0].tolist() == [5]
    again = state.lookup(batch([[5, 6]], [[]]))
    assert again.wanted_ids()["c1"].tolist() == [6] and np.array_equal(again.rows["c1"][0], read[0])


@pytest.mark.parametrize(("spec", "kind", "classes"), [(MODEL, "binary", 0), ("digits-mlp", "classes", 10)])
def test_the_signature_follows_the_model(spec: str, kind: str, classes: int) -> None:
    sig = signature_of(build_model(spec), "j", max_records=4)
    assert (sig.kind, sig.classes) == (kind, classes)
    assert sig.dense == (3 if spec == MODEL else 64)
    assert sig.features == (("c1", "c2") if spec == MODEL else ())


def test_requests_that_wait_together_are_scored_together_each_getting_its_own_records() -> None:
    import asyncio

    from serving.replica import Replica
    from serving.settings import ServeSettings

    state, factory = fresh()
    state.apply([answer("4", {"c1": ([5], np.full((1, 4), 0.5), []), "c2": ([3], np.full((1, 4), -0.2), [])})],
                factory)
    replica = Replica(ServeSettings(model=MODEL, job_token="t"), spec=build_model(MODEL))
    replica.state = state
    batches = [batch([[5]], [[3]]), batch([[5, 9], [1]], [[], [3, 3]]), batch([[]], [[7]])]
    scored: list[int] = []
    real = replica._score

    async def counting(bs):  # the forward passes and their sizes
        scored.append(sum(b.n for b in bs))
        return await real(bs)

    replica._score = counting

    async def main() -> list:
        return await asyncio.gather(*(replica.predict(b) for b in batches))

    together = asyncio.run(main())
    assert scored == [4]  # one forward pass over the three requests' four records
    for b, got in zip(batches, together, strict=True):
        alone = model_outputs(replica.signature, score(state.lookup(b)))
        assert got.version == "4" and got.outputs["logit"].shape == (b.n,)
        np.testing.assert_allclose(got.outputs["logit"], alone["logit"], rtol=0, atol=1e-6)
