"""One trainer under BSP computes what a plain local loop computes, step by step, everything real.

Under BSP a step at clock ``c`` must compute on parameters holding every update up to ``c - 1``,
the trainer's own included, even while its previous push is still on its way. One trainer on one
partition, the tables under BSP too and float32 gradient rows, so the pipeline's arithmetic is the
local loop's: after ten steps of MovieLens through Kafka, Redis and the parameter server, the dense
part and every row it wrote equal a local loop's (``nn.EmbeddingBag`` + ``SparseAdam``, ``Adam``)
to float rounding. A trainer that stepped on parameters lacking its own last update (a wait that
counted only members that had already pushed) ends up ~1e-3 off the dense part, ~1e-2 off the rows.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
import torch

from coordinator.settings import CoordinatorSettings
from datastream import load_source, produce
from services import ParameterStore, connect
from services.tables import initial_rows
from services.tables.store import pull_rows
from streamtrain.cluster import LOCAL_TRAINER, ClusterSpec, LocalCluster
from trainers.models import build_model

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

SOURCE = "movielens"
MODEL = "dlrm?schema=movielens&dim=8&row_lr=0.01"
RECORDS, BATCH, LR = 640, 64, 0.001


def local_loop(tables: dict, wanted: dict[str, np.ndarray]) -> tuple[dict[str, torch.Tensor], dict[str, np.ndarray]]:
    """The dense state and the rows of ``wanted`` after a plain local loop over the same records."""
    train = load_source(SOURCE, split="train").read(limit=RECORDS)
    spec = build_model(MODEL)
    bags = {}
    for name, table in tables.items():
        bag = torch.nn.EmbeddingBag(wanted[name].size, table.dim, mode=table.pooling, sparse=True)
        with torch.no_grad():
            bag.weight.copy_(torch.from_numpy(initial_rows(table, wanted[name])))
        bags[name] = bag
    sparse = torch.optim.SparseAdam([b.weight for b in bags.values()], lr=0.01)
    dense = torch.optim.Adam(spec.model.parameters(), lr=LR)
    x, y = torch.from_numpy(train.x), torch.from_numpy(train.y)
    for a in range(0, RECORDS, BATCH):
        b = a + BATCH
        pooled = {}
        for name in tables:
            col = train.ids[name]
            lo, hi = int(col.offsets[a]), int(col.offsets[b])
            pooled[name] = bags[name](torch.from_numpy(np.searchsorted(wanted[name], col.values[lo:hi])),
                                      torch.from_numpy(col.offsets[a:b] - lo))
        sparse.zero_grad()
        dense.zero_grad()
        spec.loss_fn(spec.model(x[a:b], pooled), y[a:b]).backward()
        sparse.step()
        dense.step()
    return spec.model.state_dict(), {n: bag.weight.detach().numpy() for n, bag in bags.items()}


def test_one_bsp_trainer_computes_what_the_local_loop_computes(tmp_path) -> None:
    spec = ClusterSpec(
        job="exact", topic="exact", trainers=0, producer=None,
        coordinator=CoordinatorSettings(partitions=1, optimizer="adam", lr=LR, codec="none", consistency="bsp",
                                        table_consistency="bsp"),
        trainer=replace(LOCAL_TRAINER, model=MODEL, batch_size=BATCH, eval_source="", row_dtype="float32"))
    with LocalCluster(spec, workdir=tmp_path / "cluster") as cluster:
        produce(cluster.bootstrap, spec.topic, SOURCE, partitions=1, shard_size=BATCH, split="train", limit=RECORDS)
        cluster.add_trainer()
        cluster.wait_consumed(timeout_s=180)
        cluster.quiesce()
        client = connect(cluster.redis_url)
        try:
            store = ParameterStore(client, spec.job)
            stored = store.pull().tensors
            tables = {t.name: t for t in build_model(MODEL).tables}
            train = load_source(SOURCE, split="train").read(limit=RECORDS)
            wanted = {n: np.unique(train.ids[n].values) for n in tables}
            rows = {n: got.values for n, got in
                    pull_rows(client, spec.job, tables, store.meta().groups, wanted).tables.items()}
        finally:
            client.close()
    dense, local_rows = local_loop(tables, wanted)
    for name, value in dense.items():
        assert torch.allclose(stored[name], value, rtol=0, atol=1e-5), \
            f"{name}: {float((stored[name] - value).abs().max()):.3g} off the local loop"
    for name in tables:
        assert np.allclose(rows[name], local_rows[name], rtol=0, atol=1e-5), \
            f"table {name}: {float(np.abs(rows[name] - local_rows[name]).max()):.3g} off the local loop"
