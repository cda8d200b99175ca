"""MovieLens-100K: what a plain local PyTorch loop reaches, the yardstick of ``up --example movielens``.

The same model as the job (``dlrm?schema=movielens``, :mod:`trainers.ranking`), one pass over the
train split in time order (the first 90 % of the ratings), one ``nn.EmbeddingBag(sparse=True)``
per feature holding every ID of the data set (mapped to rows up front), ``SparseAdam`` for the rows
and ``Adam`` for the dense part, one thread; scored on the held-out last 10 % by time with
scikit-learn's ``roc_auc_score`` and ``log_loss``. Writes ``bench/results/movielens.json``; prints the
mean AUC last.

    .venv/bin/python bench/movielens.py [--dim 16] [--batch 64] [--lr 0.001] [--row-lr 0.01] [--passes 1] [--seeds 3]
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

# Run as a script, this folder is first on sys.path and bench/datastream.py would hide the package.
_HERE = Path(__file__).resolve().parent
sys.path[:] = [str(_HERE.parent)] + [p for p in sys.path if Path(p or ".").resolve() != _HERE]

import numpy as np
import torch
from sklearn.metrics import log_loss, roc_auc_score

from datastream import Examples, load_source
from services.embeddings import initial_rows
from trainers.models import build_model


def local_loop(dim: int, batch: int, lr: float, row_lr: float, passes: int, seed: int) -> dict[str, float]:
    """Train one model locally; its held-out AUC and log loss."""
    torch.manual_seed(seed)
    torch.set_num_threads(1)
    train = load_source(f"movielens?repeat={passes}", split="train").read()
    test = load_source("movielens", split="test").read()
    spec = build_model(f"dlrm?schema=movielens&dim={dim}&row_lr={row_lr}", seed=seed)
    names = [t.name for t in spec.tables]
    bags, maps = {}, {}
    for table in spec.tables:
        ids = np.unique(np.concatenate([train.ids[table.name].values, test.ids[table.name].values]))
        bag = torch.nn.EmbeddingBag(ids.size, dim, mode=table.pooling, sparse=True)
        with torch.no_grad():  # the rows the parameter plane starts each ID with
            bag.weight.copy_(torch.from_numpy(initial_rows(table, ids)))
        bags[table.name], maps[table.name] = bag, ids

    def pooled(ex: Examples, start: int, stop: int) -> dict[str, torch.Tensor]:
        out = {}
        for name in names:
            col = ex.ids[name]
            lo, hi = int(col.offsets[start]), int(col.offsets[stop])
            out[name] = bags[name](torch.from_numpy(np.searchsorted(maps[name], col.values[lo:hi])),
                                   torch.from_numpy(col.offsets[start:stop] - lo))
        return out

    model = spec.model
    sparse = torch.optim.SparseAdam([b.weight for b in bags.values()], lr=row_lr)
    dense = torch.optim.Adam(model.parameters(), lr=lr)
    x, y = torch.from_numpy(train.x), torch.from_numpy(train.y)
    t0 = time.perf_counter()
    for start in range(0, len(train), batch):
        stop = min(start + batch, len(train))
        loss = spec.loss_fn(model(x[start:stop], pooled(train, start, stop)), y[start:stop])
        sparse.zero_grad()
        dense.zero_grad()
        loss.backward()
        sparse.step()
        dense.step()
    seconds = time.perf_counter() - t0
    with torch.no_grad():
        logits = model(torch.from_numpy(test.x), pooled(test, 0, len(test))).double().numpy()
    p = 1.0 / (1.0 + np.exp(-logits))
    return {"auc": float(roc_auc_score(test.y, logits)), "log_loss": float(log_loss(test.y, p, labels=[0, 1])),
            "records": len(train), "records_per_s": len(train) / seconds}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dim", type=int, default=16)
    parser.add_argument("--batch", type=int, default=64, help="the trainers' default batch")
    parser.add_argument("--lr", type=float, default=0.001)
    parser.add_argument("--row-lr", type=float, default=0.01)
    parser.add_argument("--passes", type=int, default=1)
    parser.add_argument("--seeds", type=int, default=3, help="repeat with seeds 0..N-1")
    args = parser.parse_args()
    runs = []
    for seed in range(args.seeds):
        r = local_loop(args.dim, args.batch, args.lr, args.row_lr, args.passes, seed)
        runs.append({"seed": seed, **r})
        print(f"local loop, movielens, dim {args.dim}, batch {args.batch}, lr {args.lr:g}, row lr {args.row_lr:g}, "
              f"{args.passes} pass(es), seed {seed}: held-out AUC {r['auc']:.4f}, log loss {r['log_loss']:.4f} "
              f"({r['records']:,} records, {r['records_per_s']:,.0f} records/s)")
    results = _HERE / "results" / "movielens.json"
    results.parent.mkdir(exist_ok=True)
    results.write_text(json.dumps({"machine": platform.platform(), "settings": vars(args), "runs": runs}, indent=2))
    mean = sum(r["auc"] for r in runs) / len(runs)
    print(f"held-out AUC of the local loop, movielens, mean of {len(runs)} seed(s): {mean:.4f}")


if __name__ == "__main__":
    main()
