"""What ``bench/pipeline.py`` compares the pipeline against, for data at rest on the same machine.

1. :func:`local_throughput`: samples/s of a plain local PyTorch loop (the ceiling).
2. :func:`ddp_throughput`: samples/s of PyTorch ``DistributedDataParallel`` (gloo on
   loopback) with ``procs`` processes of ``threads`` torch threads each, same model,
   per-rank batch, Adam, data already in memory: the peer a user would pick instead.
3. :func:`local_time_to_accuracy`: training seconds (evaluation excluded) and records a
   plain local loop needs to reach a held-out accuracy target.
4. :func:`local_accuracy`: the held-out accuracy of a plain local loop after a given number of
   records (what a pipeline run that trained on as many is compared with).
"""

from __future__ import annotations

import datetime
import os
import time
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.nn.parallel import DistributedDataParallel

from datastream import load_source
from datastream.sources import one_pass
from streamtrain.launcher import free_port
from trainers.models import build_model


def local_throughput(model: str, batch: int, threads: int, source: str, records: int, lr: float = 0.001, *,
                     fused: bool = False) -> float:
    """Samples/s of a plain local loop (the ceiling): forward, backward, Adam step, data in memory.
    ``fused``: Adam with PyTorch's fused kernel (``torch.optim.Adam(..., fused=True)``) instead of its
    default (a per-tensor loop on the CPU), what the trainers' inner optimizer of local steps uses."""
    previous_threads = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        xs, ys = load_source(source, split="train").read(limit=records)
        x, y = torch.from_numpy(xs).float(), torch.from_numpy(ys).long()
        spec = build_model(model)
        opt = torch.optim.Adam(spec.model.parameters(), lr=lr, fused=fused or None)
        steps = len(x) // batch

        def epoch(n: int) -> None:
            for i in range(n):
                xb, yb = x[i * batch:(i + 1) * batch], y[i * batch:(i + 1) * batch]
                opt.zero_grad(set_to_none=True)
                spec.loss_fn(spec.model(xb), yb).backward()
                opt.step()

        epoch(min(steps, 20))  # warm-up
        t0 = time.perf_counter()
        epoch(steps)
        return steps * batch / (time.perf_counter() - t0)
    finally:
        torch.set_num_threads(previous_threads)


def _ddp_rank(rank: int, procs: int, port: int, threads: int, model: str, batch: int,
              x: torch.Tensor, y: torch.Tensor, lr: float, warmup_steps: int, results: Any) -> None:
    """One DDP rank: warm up, then time one pass over its interleaved slice; rank 0 reports."""
    torch.set_num_threads(threads)
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    dist.init_process_group("gloo", rank=rank, world_size=procs, timeout=datetime.timedelta(seconds=60))
    try:
        x, y = x[rank::procs], y[rank::procs]
        spec = build_model(model, seed=0)
        ddp = DistributedDataParallel(spec.model)
        opt = torch.optim.Adam(ddp.parameters(), lr=lr)
        steps = len(x) // batch

        def run(n: int) -> None:
            for i in range(n):
                xb, yb = x[i * batch:(i + 1) * batch], y[i * batch:(i + 1) * batch]
                opt.zero_grad(set_to_none=True)
                spec.loss_fn(ddp(xb), yb).backward()
                opt.step()

        run(min(steps, warmup_steps))
        dist.barrier()
        t0 = time.perf_counter()
        run(steps)
        dist.barrier()
        elapsed = time.perf_counter() - t0
        if rank == 0:
            results.put({"samples_per_s": procs * batch * steps / elapsed, "procs": procs,
                         "threads": threads, "batch": batch, "steps": steps, "elapsed_s": elapsed})
    finally:
        dist.destroy_process_group()


def ddp_throughput(model: str, batch: int, *, procs: int = 2, threads: int = 1, source: str,
                   records: int, lr: float = 0.001, warmup_steps: int = 10) -> dict[str, Any]:
    """Global samples/s of PyTorch DDP (gloo, loopback) with ``procs`` spawned processes.

    The train split of ``source`` (``records`` records) is loaded once here; rank r trains on
    records r, r + procs, ... with per-rank batch ``batch``. Like ``ceiling()`` in
    bench/pipeline.py, each rank warms up on its first ``warmup_steps`` batches, then one full
    pass over its slice (``steps`` batches) is timed between two barriers.

    Returns:
        ``samples_per_s`` (procs * batch * steps / elapsed_s), ``procs``, ``threads``,
        ``batch``, ``steps`` (per rank), ``elapsed_s``.

    Raises:
        ValueError: fewer than one batch per rank.
        RuntimeError: a rank failed; the message holds its traceback.
    """
    xs, ys = load_source(source, split="train").read(limit=records)
    if len(xs) // procs < batch:
        raise ValueError(f"{len(xs)} records give no full batch of {batch} to each of {procs} ranks")
    x, y = torch.from_numpy(xs).float(), torch.from_numpy(ys).long()
    results = mp.get_context("spawn").SimpleQueue()
    args = (procs, free_port(), threads, model, batch, x, y, lr, warmup_steps, results)
    try:
        mp.spawn(_ddp_rank, args=args, nprocs=procs, join=True)  # joins all; kills the rest if one fails
    except (mp.ProcessRaisedException, mp.ProcessExitedException) as exc:
        raise RuntimeError(f"DDP rank failed:\n{exc}") from exc
    if results.empty():
        raise RuntimeError("DDP rank 0 exited without reporting")
    return results.get()


def local_time_to_accuracy(model: str, batch: int, *, threads: int, source: str, target: float,
                           lr: float = 0.001, optimizer: str = "adam", max_records: int,
                           eval_every_records: int = 2048, eval_limit: int = 2000,
                           fused: bool = False) -> dict[str, Any]:
    """Training seconds and records a plain local loop needs to reach held-out accuracy ``target``.

    Trains on the train split of ``source`` (at most ``max_records`` records, in memory; a
    shorter bounded source is passed over again), evaluating every ``eval_every_records`` on
    at most ``eval_limit`` records of the test split of the same spec without ``repeat``.
    The clock stops while evaluating. Stops at the first evaluation at/above ``target`` or
    once ``max_records`` are consumed (then evaluates a last time).
    ``fused``: the optimizer with PyTorch's fused kernel instead of its default.

    Returns:
        ``reached``, ``seconds`` and ``records`` at that evaluation (or at the end),
        ``accuracy`` (the last one), ``curve``: ``[(records, seconds, accuracy), ...]``.
    """
    if optimizer not in ("adam", "sgd"):
        raise ValueError(f"optimizer must be adam or sgd, got {optimizer!r}")
    previous_threads = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        xs, ys = load_source(source, split="train").read(limit=max_records)
        xts, yts = load_source(one_pass(source), split="test").read(limit=eval_limit)
        x, y = torch.from_numpy(xs).float(), torch.from_numpy(ys).long()
        xt, yt = torch.from_numpy(xts).float(), torch.from_numpy(yts).long()
        spec = build_model(model)
        if not spec.classification:
            raise ValueError(f"model {model!r} is not a classifier; accuracy is undefined")
        params = spec.model.parameters()
        opt = (torch.optim.Adam(params, lr=lr, fused=fused or None) if optimizer == "adam"
               else torch.optim.SGD(params, lr=lr, momentum=0.9, fused=fused or None))

        def accuracy() -> float:
            with torch.no_grad():
                return (spec.model(xt).argmax(dim=1) == yt).float().mean().item()

        curve: list[tuple[int, float, float]] = []
        records, seconds, next_eval = 0, 0.0, eval_every_records
        while records < max_records:
            t0 = time.perf_counter()
            while records < max_records and records < next_eval:
                start = records % len(x)
                n = min(batch, len(x) - start, max_records - records)
                opt.zero_grad(set_to_none=True)
                spec.loss_fn(spec.model(x[start:start + n]), y[start:start + n]).backward()
                opt.step()
                records += n
            seconds += time.perf_counter() - t0
            next_eval += eval_every_records
            curve.append((records, seconds, accuracy()))
            if curve[-1][2] >= target:
                break
        return {"reached": curve[-1][2] >= target, "seconds": seconds, "records": records,
                "accuracy": curve[-1][2], "curve": curve}
    finally:
        torch.set_num_threads(previous_threads)


def local_accuracy(model: str, batch: int, *, threads: int, source: str, records: int, lr: float,
                   eval_limit: int = 2000) -> float:
    """Held-out accuracy of a plain local loop (Adam at ``lr``) after ``records`` records of ``source``'s
    train split (:func:`local_time_to_accuracy` with an unreachable target, scored once at the end)."""
    run = local_time_to_accuracy(model, batch, threads=threads, source=source, target=2.0, lr=lr,
                                 max_records=records, eval_every_records=records, eval_limit=eval_limit)
    return float(run["accuracy"])
