"""A trainer's side of embedding tables, without servers: lookups, pooling and gradient rows agree with
an EmbeddingBag holding the whole table; the built-in ranking model; the clock bound a step waits for."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from sklearn.metrics import log_loss, roc_auc_score

from datastream import movielens
from datastream.jagged import Jagged
from services.consistency import Consistency
from services.tables import TableSpec
from trainers.evaluate import evaluate
from trainers.models import build_model
from trainers.ranking import Dlrm, binary_logistic_loss
from trainers.rowcache import TableBound
from trainers.tables import plan_lookups, pool, row_gradients, table_inputs, table_required, wait_consistency

TABLES = {"user": TableSpec("user", 3), "item": TableSpec("item", 3, features=("item", "clicked"), pooling="mean")}


def _batch() -> dict[str, Jagged]:
    return {"user": Jagged.from_lists([[5], [9], [5], [2]]),
            "item": Jagged.from_lists([[7, 8], [], [8], [7, 7, 1]]),
            "clicked": Jagged.from_lists([[1], [8, 8], [], [3]])}


def test_lookups_pool_and_gradients_are_those_of_a_whole_table() -> None:
    ids = _batch()
    lookups = plan_lookups(TABLES, ids, 4)
    assert lookups["user"].ids.tolist() == [2, 5, 9]
    assert lookups["item"].ids.tolist() == [1, 3, 7, 8]  # both features' IDs, once each
    full = {name: torch.randn(10, 3, generator=torch.Generator().manual_seed(k)) for k, name in enumerate(TABLES)}
    rows = {name: full[name][lk.ids].numpy().copy() for name, lk in lookups.items()}
    pooled, leaves = pool(lookups, rows, torch.device("cpu"))
    target = {f: torch.randn(4, 3, generator=torch.Generator().manual_seed(9)) for f in pooled}
    sum(((pooled[f] - target[f]) ** 2).sum() for f in pooled).backward()
    grads = {g.table: g for g in row_gradients(lookups, leaves)}
    # the reference: EmbeddingBags over whole tables, gradients coalesced
    for name, spec in TABLES.items():
        bag = torch.nn.EmbeddingBag.from_pretrained(full[name].clone(), freeze=False, mode=spec.pooling, sparse=True)
        loss = 0
        for f in spec.features:
            col = ids[f]
            out = bag(torch.from_numpy(col.values), torch.from_numpy(col.offsets[:-1]))
            torch.testing.assert_close(pooled[f], out)
            loss = loss + ((out - target[f]) ** 2).sum()
        loss.backward()
        ref = bag.weight.grad.coalesce()
        assert grads[name].ids.tolist() == ref.indices()[0].tolist()
        torch.testing.assert_close(torch.from_numpy(grads[name].grads), ref.values())
    # a record without an ID for a feature pools to zeros
    assert pooled["item"][1].abs().sum() == 0 and pooled["clicked"][2].abs().sum() == 0


def test_a_feature_the_batch_lacks_pools_to_zeros() -> None:
    lookups = plan_lookups(TABLES, {"user": Jagged.from_lists([[1], [2]])}, 2)
    assert lookups["item"].ids.size == 0
    pooled, _ = pool(lookups, {"user": np.ones((2, 3), np.float32), "item": np.zeros((0, 3), np.float32)},
                     torch.device("cpu"))
    assert pooled["item"].shape == (2, 3) and pooled["item"].abs().sum() == 0
    with pytest.raises(ValueError, match="feature 'user' has 2 records, the batch 3"):
        plan_lookups(TABLES, {"user": Jagged.from_lists([[1], [2]])}, 3)


def test_the_ranking_model_declares_its_tables_and_scores_one_logit_per_record() -> None:
    spec = build_model("dlrm?features=3&dense=2&dim=4&tags=1&admit=2&row_optimizer=adagrad&row_lr=0.1")
    assert spec.binary and spec.classification and spec.loss_fn is binary_logistic_loss
    assert [t.name for t in spec.tables] == ["c1", "c2", "c3", "tags"]
    assert spec.tables[0].admit_after == 2 and spec.tables[0].optimizer.name == "adagrad"
    assert spec.tables[-1].pooling == "mean" and spec.tables[0].dim == 4
    model = spec.model
    assert isinstance(model, Dlrm)
    assert all(p.ndim in (1, 2) for p in model.parameters())  # the dense part only: no table is a parameter
    n = 5
    pooled = {f: torch.randn(n, 4) for f in ("c1", "c2", "c3", "tags")}
    out = model(torch.randn(n, 2), pooled)
    assert out.shape == (n,)
    binary_logistic_loss(out, torch.tensor([0, 1, 1, 0, 1])).backward()
    # no dense features: no bottom MLP
    bare = build_model("dlrm?features=2&dense=0&dim=3").model
    assert bare(torch.empty(2, 0), {"c1": torch.randn(2, 3), "c2": torch.randn(2, 3)}).shape == (2,)
    for bad, message in (("dlrm?colour=red", "unknown option"), ("dlrm?dim=0", "option dim=0 must be >= 1"),
                         ("dlrm?features=0", "at least one"), ("dlrm?top=a-b", "widths")):
        with pytest.raises(ValueError, match=message):
            build_model(bad)


def test_the_movielens_schema_declares_the_sources_features_without_dense_ones() -> None:
    spec = build_model("dlrm?schema=movielens&dim=8&row_lr=0.02")
    assert spec.binary and [t.name for t in spec.tables] == list(movielens.FEATURES)
    assert {t.name: t.pooling for t in spec.tables}[movielens.MULTI] == "mean"
    assert all(t.pooling == "sum" for t in spec.tables if t.name != movielens.MULTI)
    assert spec.tables[0].dim == 8 and spec.tables[0].optimizer.lr == 0.02
    model = spec.model
    assert isinstance(model, Dlrm) and model.dense == 0 and model.bottom is None
    assert model(torch.empty(3, 0), {f: torch.randn(3, 8) for f in movielens.FEATURES}).shape == (3,)
    for bad, message in (("dlrm?schema=movielens&dense=4", "schema=movielens fixes the features; drop dense"),
                         ("dlrm?schema=movielens&features=3&tags=1", "drop features, tags"),
                         ("dlrm?schema=criteo", "schema: one of clicks, movielens")):
        with pytest.raises(ValueError, match=message):
            build_model(bad)


def test_the_binary_loss_is_scikit_learns_log_loss_and_the_models_own() -> None:
    spec = build_model("dlrm?features=1&dense=2&dim=2")
    tables = {t.name: t for t in spec.tables}
    n = 64
    ids = {"c1": Jagged.from_lists([[i % 5] for i in range(n)])}
    x = torch.randn(n, 2)
    y = torch.tensor([(i * 7) % 3 == 0 for i in range(n)]).long()

    def pull(wanted: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        return {k: np.stack([np.sin(v), np.cos(v)], axis=1).astype(np.float32) for k, v in wanted.items()}  # row of ID

    result = evaluate(spec.model, spec.loss_fn, x, y, version=1, classification=True, binary=True, batch_size=16,
                      inputs=table_inputs(tables, ids, pull, torch.device("cpu")))
    with torch.no_grad():
        logits = spec.model(x, *table_inputs(tables, ids, pull, torch.device("cpu"))(0, n)).double()
    p = torch.sigmoid(logits).numpy()
    assert result.loss == pytest.approx(log_loss(y.numpy(), p, labels=[0, 1]), rel=1e-9)
    assert result.loss == pytest.approx(float(spec.loss_fn(logits.float(), y)), rel=1e-5)  # the same quantity
    assert result.auc == pytest.approx(roc_auc_score(y.numpy(), logits.numpy()))


def test_a_step_waits_for_the_stricter_synchronous_part() -> None:
    ssp3, ssp1 = Consistency("ssp", 3), Consistency("ssp", 1)
    assert wait_consistency(ssp3, None) == ssp3
    assert wait_consistency(ssp3, TableBound("asp", 8)) == ssp3  # async tables never wait
    assert wait_consistency(ssp3, TableBound("ssp", 1)) == ssp1
    assert wait_consistency(ssp1, TableBound("ssp", 3)) == ssp1
    assert wait_consistency(Consistency("asp", 0), TableBound("bsp", 0)) == Consistency("bsp", 0)
    assert wait_consistency(Consistency("bsp", 0), TableBound("ssp", 2)).mode == "bsp"
    assert table_required(TableBound("ssp", 2), 10) == 7 and table_required(TableBound("asp", 2), 10) is None


def test_binary_scores_have_an_auc_and_take_the_pooled_rows() -> None:
    spec = build_model("dlrm?features=1&dense=1&dim=2")
    tables = {t.name: t for t in spec.tables}
    ids = {"c1": Jagged.from_lists([[i % 3] for i in range(40)])}
    x = torch.randn(40, 1)
    y = torch.tensor([i % 2 for i in range(40)])
    pulls = []

    def pull(wanted: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        pulls.append({k: v.tolist() for k, v in wanted.items()})
        return {k: np.ones((v.size, 2), np.float32) for k, v in wanted.items()}

    result = evaluate(spec.model, spec.loss_fn, x, y, version=3, classification=True, binary=True, batch_size=16,
                      inputs=table_inputs(tables, ids, pull, torch.device("cpu")))
    assert result.auc is not None and 0.0 <= result.auc <= 1.0 and result.accuracy is not None
    assert len(pulls) == 3 and pulls[0] == {"c1": [0, 1, 2]}  # one pull per held-out batch, its IDs once
    one_class = evaluate(spec.model, spec.loss_fn, x, torch.zeros(40, dtype=torch.long), version=3,
                         classification=True, binary=True, inputs=table_inputs(tables, ids, pull, torch.device("cpu")))
    assert one_class.auc is None
