"""Parameter-plane scale-out on a real Redis Cluster, and what each part costs per update, pull and record.

The measured inputs of ``docs/scaling.md``.

In one run, against ``streamtrain.launcher.RedisCluster(masters=3)`` on loopback:

1. **Apply throughput with 1, 2 and 4 shard groups.** The 1.86M-parameter ``mlp-2m``
   (``trainers.build_model``) is created with G groups and the job defaults (codec
   ``topk+fp16`` at 1 %, ``lazyadam``, lr 0.005: ``CoordinatorSettings`` and
   ``TrainerSettings``). The job name is chosen so that the groups' slots ``{job:g<g>}``
   are spread evenly over the masters and the job's slot ``{job}`` is alone on one (with
   1 and 2 groups; with 4 it shares a master with one group: see :func:`pick_job`).
   One ``streamtrain ps --groups G --group g`` **process** per group (as in production:
   no GIL shared between groups) starts and applies a warm-up update; then every
   server is paused (SIGSTOP), ``--updates`` updates are pushed by a ``Pusher`` (real
   top-k gradients of random values, with error feedback), the servers are resumed
   together (SIGCONT) and the clock runs until ``unapplied`` is 0: every update applied
   by every group and accounted in the job's slot. Best of ``--rounds``.
2. **Costs per update**, from the same runs: trainer-side encode and push CPU
   (``time.process_time``), the encoded bytes (``PushResult.wire_bytes``), and for each
   master its Redis CPU (``INFO cpu``), bytes in and out (``INFO stats``) and script time
   (``INFO commandstats``) while pushing and while applying, split by role (the job's
   slot, each group's slot; see :func:`summary`); each ``ps`` process's CPU (``/proc/<pid>/stat``).
3. **Costs per pull** (with the servers in this process, stepped by hand): a full pull,
   a delta pull after one update and after ``--burst`` updates (what a trainer reads
   when others pushed meanwhile), and an SSP clock read (``read_job_clocks``): bytes
   read (``Snapshot.wire_bytes``), client CPU, Redis CPU per node.
4. **Costs per record**: producer encode (``encode_shard``) and consumer decode
   (``decode_record`` to tensors) of ``--records`` records of the mlp-2m's 784-feature
   synthetic stream, in memory; then, unless ``--no-kafka``, ``--kafka-records`` records
   of that stream through a real broker (``KafkaBroker``, its idle CPU subtracted): the
   broker's CPU per record produced (idempotent, ``acks=all``) and consumed
   (``ShardConsumer``), and the producer's and consumer's.

This machine has 2 cores, shared by every Redis node, every ``ps`` process and this
script: the point of part 1 is that nothing serialises on one node or one process, not
the absolute figures. Writes ``bench/results/scale.json``; prints the apply ratio
(4 groups / 1 group) last.

    .venv/bin/python bench/scale.py [--updates 960] [--rounds 3] [--groups 1,2,4] [--no-kafka]
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import signal
import statistics
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar, cast

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a file: the repository first (bench.harness)

import numpy as np
import redis
import torch

from bench import harness
from common.keys import JobKeys
from coordinator.settings import CoordinatorSettings
from datastream import ShardConsumer, decode_record, encode_shard, iter_shards, load_source, produce
from services import (
    OptimizerConfig,
    ParameterServer,
    ParameterStore,
    Pusher,
    ServerSettings,
    connect,
    read_job_clocks,
    unapplied_updates,
)
from services.protocol import own_shards
from streamtrain.launcher import KafkaBroker, RedisCluster, ServiceProcess
from trainers import build_model
from trainers.settings import TrainerSettings

T = TypeVar("T")

MODEL = "mlp-2m"
SOURCE = "synthetic?features=784&classes=10&seed=1"  # the mlp-2m's stream in bench/pipeline.py
SHARD_RECORDS = 256  # `streamtrain produce --shard-size` default


# -- measuring -------------------------------------------------------------------------------------
class Masters:
    """Direct clients to each master of the cluster, to read its INFO before and after a phase."""

    def __init__(self, cluster: RedisCluster, client: redis.Redis) -> None:
        self.names = sorted(n.name for n in cast("redis.cluster.RedisCluster", client).get_primaries())
        by_name = {n.address: n for n in cluster.nodes}
        self.clients = {name: redis.Redis(host=by_name[name].host, port=by_name[name].port,
                                          password=cluster.password) for name in self.names}

    def sample(self, commands: bool = True) -> dict[str, dict[str, float]]:
        """Per master: Redis CPU seconds, bytes in and out, and (``commands``) calls and usec per command."""
        out = {}
        for name, c in self.clients.items():
            info = c.info("cpu", "stats", "commandstats") if commands else c.info("cpu", "stats")
            row = {"cpu_s": float(info["used_cpu_user"]) + float(info["used_cpu_sys"]),
                   "in_bytes": float(info["total_net_input_bytes"]),
                   "out_bytes": float(info["total_net_output_bytes"])}
            for key, value in info.items():
                if key.startswith("cmdstat_"):
                    row[f"{key[8:]}_calls"] = float(value["calls"])
                    row[f"{key[8:]}_usec"] = float(value["usec"])
            out[name] = row
        return out

    @staticmethod
    def delta(before: Mapping[str, Mapping[str, float]], after: Mapping[str, Mapping[str, float]]
              ) -> dict[str, dict[str, float]]:
        return {n: {k: v - before[n].get(k, 0.0) for k, v in after[n].items()} for n in after}

    def close(self) -> None:
        for c in self.clients.values():
            c.close()


def per(total: Mapping[str, float], n: float, keys: Sequence[str] = ("cpu_s", "in_bytes", "out_bytes", "evalsha_usec",
                                                                     "xread_usec", "exec_usec")) -> dict[str, float]:
    """``total``'s ``keys`` divided by ``n`` (CPU in ms, script/command time in µs, bytes as bytes)."""
    out = {}
    for k in keys:
        v = total.get(k, 0.0) / n
        out["cpu_ms" if k == "cpu_s" else k] = v * 1e3 if k == "cpu_s" else v
    return out


# -- the job ---------------------------------------------------------------------------------------
def pick_job(client: redis.Redis, groups: int, masters: Sequence[str]) -> tuple[str, dict]:
    """A job name whose G group slots are spread evenly over the masters and whose slot ``{job}`` is
    alone on a master when that can be had, else on a master holding the fewest groups; and where
    each slot lives.

    CRC16 is linear, so the slots of ``{job:g0}`` .. ``{job:g3}`` of one name sit about a quarter of
    the slot space apart: four groups always span all three masters, and the job's slot then
    shares a master with one group.
    """
    nodes_of = cast("redis.cluster.RedisCluster", client)  # connect() types a cluster client as a Redis
    best: tuple[int, str, str, list[str]] | None = None
    for _ in range(5000):
        job = f"scale{groups}-{uuid.uuid4().hex[:8]}"
        keys = JobKeys(job)
        home = nodes_of.get_node_from_key(keys.meta).name
        nodes = [nodes_of.get_node_from_key(keys.group(g).version).name for g in range(groups)]
        spread = [m for m in masters if m != home] if groups < len(masters) else list(masters)
        counts = [nodes.count(m) for m in spread]
        if set(nodes) - set(spread) or max(counts) - min(counts) > 1 or nodes.count(home) > min(counts):
            continue
        if best is None or nodes.count(home) < best[0]:
            best = (nodes.count(home), job, home, nodes)
        if best[0] == 0:
            break
    if best is None:
        raise RuntimeError(f"no job name spreads {groups} group slot(s) evenly over the masters")
    _, job, home, nodes = best
    keys = JobKeys(job)
    return job, {"job": {"slot": nodes_of.keyslot(keys.meta), "node": home},
                 "groups": [{"group": g, "slot": nodes_of.keyslot(keys.group(g).version), "node": nodes[g]}
                            for g in range(groups)]}


def membership(client: redis.Redis, job: str, partitions: int = 1) -> None:
    """What the coordinator would have written: generation 1, one member owning the partitions."""
    keys = JobKeys(job)
    client.set(keys.generation, 1)
    client.hset(keys.members, "bench", "{}")
    client.hset(keys.assignment, mapping={str(p): "bench|1" for p in range(partitions)})


class Trainer:
    """A trainer's push side: a Pusher whose encode time is recorded apart from the rest of the push."""

    def __init__(self, client: redis.Redis, job: str, tensors: Mapping[str, torch.Tensor],
                 max_pending: int) -> None:
        self.pusher = Pusher(client, job, "bench", codec=CoordinatorSettings().codec,
                             codec_options={"density": TrainerSettings().topk_density}, max_pending=max_pending)
        gen = torch.Generator().manual_seed(0)
        # a few gradients, reused: with error feedback every encoded update still differs
        self.grads = [{n: torch.randn(t.shape, generator=gen) * 1e-3 for n, t in tensors.items()} for _ in range(8)]
        self.clock = 0
        self.encode_cpu_s = 0.0
        encode = self.pusher.encode

        def timed(grads: Mapping[str, torch.Tensor]
                  ) -> tuple[dict[int, bytes], dict[int, torch.Tensor], dict[int, torch.Tensor], int]:
            t = time.process_time()
            try:
                return encode(grads)
            finally:
                self.encode_cpu_s += time.process_time() - t

        self.pusher.encode = timed  # type: ignore[method-assign]  # the real encoder, timed

    def push(self, n: int) -> dict[str, float]:
        """Push ``n`` updates; per update: encode and push CPU (ms), wall time (ms), bytes sent."""
        enc0, wire, raw = self.encode_cpu_s, 0, 0
        cpu, wall = time.process_time(), time.perf_counter()
        for _ in range(n):
            self.clock += 1
            c = self.clock
            r = self.pusher.push(self.grads[c % len(self.grads)], generation=1, clock=c, offsets={0: (c - 1, c)},
                                 samples=[("bench", c - 1, 1)], batch_size=1)
            wire += r.wire_bytes
            raw += r.raw_bytes
        wall = time.perf_counter() - wall
        cpu = time.process_time() - cpu
        encode = self.encode_cpu_s - enc0
        return {"encode_cpu_ms": encode / n * 1e3, "push_cpu_ms": (cpu - encode) / n * 1e3,
                "wall_ms": wall / n * 1e3, "wire_bytes": wire / n, "raw_bytes": raw / n}


@contextlib.contextmanager
def servers(url: str, job: str, groups: int) -> Iterator[list[ServiceProcess]]:
    """One ``streamtrain ps`` process per group (the URL, which holds the password, in the environment)."""
    procs = [ServiceProcess(f"ps-{groups}-{g}", ["ps", "--log-level", "WARNING", "--job", job,
                                                 "--groups", str(groups), "--group", str(g)],
                            env={"STREAMTRAIN_REDIS_URL": url}) for g in range(groups)]
    try:
        for p in procs:
            p.start()
        yield procs
    finally:
        for p in procs:
            if p.pid is not None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(p.pid, signal.SIGCONT)  # a paused server would not see its SIGTERM
            p.stop()


def check_alive(procs: Sequence[ServiceProcess]) -> None:
    for p in procs:
        if p.returncode is not None:
            raise RuntimeError(f"{p.name} exited with {p.returncode}:\n{p.log_tail()}")


def wait_applied(client: redis.Redis, job: str, procs: Sequence[ServiceProcess],
                 timeout_s: float, poll_s: float = 0.01) -> None:
    deadline = time.monotonic() + timeout_s
    while unapplied_updates(client, job) > 0:
        check_alive(procs)
        if time.monotonic() > deadline:
            raise RuntimeError(f"{unapplied_updates(client, job)} update(s) of {job} still unapplied "
                               f"after {timeout_s:.0f} s")
        time.sleep(poll_s)


def roles(placement: Mapping) -> dict[str, str]:
    """Master -> what it holds in this configuration (``job``, ``g0+g2``, or ``-``)."""
    out: dict[str, list[str]] = {}
    out.setdefault(placement["job"]["node"], []).append("job")
    for g in placement["groups"]:
        out.setdefault(g["node"], []).append(f"g{g['group']}")
    return {n: "+".join(v) for n, v in out.items()}


def throughput(cluster: RedisCluster, client: redis.Redis, masters: Masters,
               tensors: Mapping[str, torch.Tensor], groups: int, args: argparse.Namespace) -> dict:
    """Part 1 and 2 for one group count: rounds of push N (servers paused) / apply N (timed)."""
    job, placement = pick_job(client, groups, masters.names)
    defaults = CoordinatorSettings()
    store = ParameterStore(client, job)
    meta = store.init_model(tensors, groups=groups, optimizer=OptimizerConfig(name=defaults.optimizer, lr=defaults.lr))
    membership(client, job)
    trainer = Trainer(client, job, tensors, max_pending=args.updates + 16)
    group_params = [sum(meta.layout.shards[i].numel for i in own_shards(meta.layout, groups, g)) for g in range(groups)]
    home = placement["job"]["node"]
    group_nodes = sorted({g["node"] for g in placement["groups"]})
    rounds = []
    push_tot: dict[str, float] = {}
    push_nodes: dict[str, dict[str, float]] = {}
    apply_nodes: dict[str, dict[str, float]] = {}
    ps_cpu = [0.0] * groups
    pushed = 0
    with servers(cluster.url, job, groups) as procs:
        trainer.push(1)  # warm-up: every server loaded and applied one update
        wait_applied(client, job, procs, timeout_s=300)
        pids = [cast(int, p.pid) for p in procs]  # all running
        for r in range(args.rounds):
            for pid in pids:
                os.kill(pid, signal.SIGSTOP)
            time.sleep(0.3)  # a server mid-round finishes nothing while paused: the log only grows
            before = masters.sample()
            costs = trainer.push(args.updates)
            after = masters.sample()
            for k, v in costs.items():
                push_tot[k] = push_tot.get(k, 0.0) + v * args.updates
            for n, d in Masters.delta(before, after).items():
                for k, v in d.items():
                    push_nodes.setdefault(n, {})[k] = push_nodes.get(n, {}).get(k, 0.0) + v
            pushed += args.updates
            before, cpu0 = masters.sample(), [harness.cpu_seconds(pid) for pid in pids]
            t = time.perf_counter()
            for pid in pids:
                os.kill(pid, signal.SIGCONT)
            wait_applied(client, job, procs, timeout_s=600, poll_s=0.005)
            elapsed = time.perf_counter() - t
            after, cpu1 = masters.sample(), [harness.cpu_seconds(pid) for pid in pids]
            for n, d in Masters.delta(before, after).items():
                for k, v in d.items():
                    apply_nodes.setdefault(n, {})[k] = apply_nodes.get(n, {}).get(k, 0.0) + v
            ps_cpu = [a + c1 - c0 for a, c0, c1 in zip(ps_cpu, cpu0, cpu1, strict=True)]
            busy = (sum(d["cpu_s"] for d in Masters.delta(before, after).values())
                    + sum(cpu1) - sum(cpu0)) / elapsed  # Redis masters and ps processes, in cores
            rounds.append({"updates": args.updates, "seconds": elapsed, "updates_per_s": args.updates / elapsed,
                           "cores_busy": busy})
            print(f"  {groups} group(s), round {r + 1}: {args.updates} updates applied and accounted in "
                  f"{elapsed:.2f} s ({args.updates / elapsed:.0f}/s; Redis and ps busy {busy:.2f} cores)", flush=True)
    assert int(cast(bytes, client.hget(JobKeys(job).applied_clocks, "bench"))) == trainer.clock
    pulls = pull_costs(cluster.url, client, masters, job, groups, trainer, tensors, args)
    role = roles(placement)
    cfg = {
        "groups": groups, "job": job, "placement": placement, "roles": role, "group_params": group_params,
        "rounds": rounds, "updates_per_s": max(r["updates_per_s"] for r in rounds),
        "trainer_per_update": {k: v / pushed for k, v in push_tot.items()},
        "push_per_update": {n: {"role": role.get(n, "-"), **per(d, pushed)} for n, d in push_nodes.items()},
        "apply_per_update": {n: {"role": role.get(n, "-"), **per(d, pushed)} for n, d in apply_nodes.items()},
        "job_node": home, "group_nodes": group_nodes,
        "ps_cpu_ms_per_update": [c / pushed * 1e3 for c in ps_cpu],
        "pulls": pulls,
    }
    cfg["summary"] = summary(cfg)
    return cfg


def pull_costs(url: str, client: redis.Redis, masters: Masters, job: str, groups: int,
               trainer: Trainer, tensors: Mapping[str, torch.Tensor], args: argparse.Namespace) -> dict:
    """Part 3: full pulls, delta pulls after 1 and after ``--burst`` updates, SSP clock reads.

    The group servers run here, stepped by hand (the ``ps`` processes are stopped), so that
    nothing else touches Redis inside a measured pull. Each measured call is bracketed by one
    ``INFO cpu stats`` per master; the cost of an empty bracket is subtracted.
    """
    store = ParameterStore(client, job)
    ps = [ParameterServer(ServerSettings(redis_url=url, job=job, group=g, groups=groups, block_ms=1,
                                         batch=max(16, args.burst)), client=client) for g in range(groups)]
    for s in ps:
        s.load()
    params = {n: torch.empty_like(t) for n, t in tensors.items()}

    def bracket(fn: Callable[[], object]) -> tuple[object, float, dict[str, dict[str, float]]]:
        before = masters.sample(commands=False)
        t = time.process_time()
        got = fn()
        cpu = time.process_time() - t
        return got, cpu, Masters.delta(before, masters.sample(commands=False))

    def measure(fn: Callable[[], object], n: int, prepare: Callable[[], None] = lambda: None) -> dict:
        wire, cpu, nodes = [], [], []
        for _ in range(n):
            prepare()
            snap, c, d = bracket(fn)
            wire.append(getattr(snap, "wire_bytes", 0))
            cpu.append(c)
            nodes.append(d)
        empty = [bracket(lambda: None)[2] for _ in range(n)]
        out: dict[str, Any] = {"wire_bytes": statistics.fmean(wire), "client_cpu_ms": statistics.fmean(cpu) * 1e3,
                               "nodes": {}}
        for name in masters.names:
            redis_ms = statistics.fmean(d[name]["cpu_s"] for d in nodes) - statistics.fmean(
                d[name]["cpu_s"] for d in empty)
            sent = statistics.fmean(d[name]["out_bytes"] for d in nodes) - statistics.fmean(
                d[name]["out_bytes"] for d in empty)
            out["nodes"][name] = {"cpu_ms": max(0.0, redis_ms) * 1e3, "out_bytes": max(0.0, sent)}
        out["redis_cpu_ms"] = sum(v["cpu_ms"] for v in out["nodes"].values())
        out["redis_out_bytes"] = sum(v["out_bytes"] for v in out["nodes"].values())
        return out

    def apply(n: int) -> Callable[[], None]:
        def go() -> None:
            trainer.push(n)
            for s in ps:
                target = s.applied + n
                while s.applied < target:
                    s.step()
        return go

    held: dict[str, Any] = {}

    def delta() -> object:
        held["snap"] = store.pull(held["snap"], out=params)
        return held["snap"]

    full = measure(lambda: store.pull(out=params), args.pulls)
    held["snap"] = store.pull(out=params)
    one = measure(delta, args.pulls, apply(1))
    burst = measure(delta, max(3, args.pulls // 4), apply(args.burst))
    clocks = measure(lambda: read_job_clocks(client, job), args.pulls)
    return {"full": full, "delta_after_1": one, f"delta_after_{args.burst}": burst, "clock_read": clocks,
            "model_bytes": 4 * sum(t.numel() for t in tensors.values())}


# -- records ---------------------------------------------------------------------------------------
def record_costs(records: int) -> dict:
    """Part 4 without Kafka: producer encode and consumer decode of ``records`` records, CPU per record."""
    shards = list(iter_shards(load_source(SOURCE), SHARD_RECORDS, records))
    t = time.process_time()
    values = [encode_shard(x, y, producer_id="bench", first_seq=i * SHARD_RECORDS) for i, (x, y) in enumerate(shards)]
    encode = time.process_time() - t
    t = time.process_time()
    for i in range(0, len(values), 4):  # ~1024-record batches, as the consumer assembles them
        recs = [decode_record(v, feature_dim=784, label_kind="classification") for v in values[i:i + 4]]
        torch.from_numpy(np.concatenate([r.x for r in recs]).astype(np.float32, copy=False))
        torch.from_numpy(np.concatenate([r.y for r in recs]).astype(np.int64, copy=False))
    decode = time.process_time() - t
    n = sum(len(x) for x, _ in shards)
    return {"records": n, "shard_records": SHARD_RECORDS, "bytes_per_record": sum(map(len, values)) / n,
            "encode_us_per_record": encode / n * 1e6, "decode_us_per_record": decode / n * 1e6}


def kafka_costs(records: int, warmup: int) -> dict:
    """Part 4 through a real broker: produce ``records`` records (after ``warmup`` others), consume them."""
    with KafkaBroker(log_level="WARN") as broker:
        pid = broker.pid
        assert pid is not None  # started
        produce(broker.bootstrap, "warmup", load_source(SOURCE), partitions=4, shard_size=SHARD_RECORDS,
                limit=warmup)
        time.sleep(2.0)
        c0, t0 = harness.cpu_seconds(pid), time.monotonic()
        time.sleep(3.0)
        idle = (harness.cpu_seconds(pid) - c0) / (time.monotonic() - t0)  # the broker's background CPU per second

        def window(fn: Callable[[], T]) -> tuple[T, float, float, float]:
            b, c, t = harness.cpu_seconds(pid), time.process_time(), time.monotonic()
            got = fn()
            wall = time.monotonic() - t
            return got, max(0.0, harness.cpu_seconds(pid) - b - idle * wall), time.process_time() - c, wall

        report, b_prod, c_prod, w_prod = window(lambda: produce(
            broker.bootstrap, "scale", load_source(SOURCE), partitions=4, shard_size=SHARD_RECORDS, limit=records))
        n = report.records

        def consume() -> int:
            got = 0
            with ShardConsumer(broker.bootstrap, "scale", max_records_per_batch=1024, prefetch=8, dlq=False,
                               fetch_max_bytes=64 << 20, fetch_max_wait_ms=100) as consumer:
                ends = consumer.end_offsets()
                consumer.assign(dict.fromkeys(ends, 0))
                reached = dict.fromkeys(ends, 0)
                while any(reached[p] < ends[p] for p in ends):
                    batch = consumer.poll(10.0)
                    if batch is None:
                        raise RuntimeError(f"no batch within 10 s at {reached} of {ends}")
                    got += len(batch)
                    reached.update(batch.next_offsets)
            return got

        got, b_cons, c_cons, w_cons = window(consume)
        if got != n:
            raise RuntimeError(f"consumed {got} records, produced {n}")
    return {"records": n, "broker_idle_cpu_per_s": idle,
            "produce": {"records_per_s": n / w_prod, "broker_cpu_us_per_record": b_prod / n * 1e6,
                        "producer_cpu_us_per_record": c_prod / n * 1e6},
            "consume": {"records_per_s": n / w_cons, "broker_cpu_us_per_record": b_cons / n * 1e6,
                        "consumer_cpu_us_per_record": c_cons / n * 1e6}}


# -- report ----------------------------------------------------------------------------------------
def redis_version() -> str:
    out = subprocess.run(["redis-server", "--version"], capture_output=True, text=True, check=False).stdout
    return out.split("v=", 1)[1].split()[0] if "v=" in out else out.strip()


def summary(cfg: dict) -> dict:
    """Per update, by role: the job's slot (push and apply phases), one group's share of its node, the ps
    processes. Where the job's master also holds a group, that group's share is estimated from the
    masters that hold groups only (CPU and script time per group, bytes per parameter held: the
    groups differ in size) and subtracted: the job slot's figures are then estimates."""
    home = cfg["job_node"]
    held = {n: [g["group"] for g in cfg["placement"]["groups"] if g["node"] == n] for n in cfg["push_per_update"]}
    pure = [n for n in cfg["group_nodes"] if n != home]
    params = {n: sum(cfg["group_params"][g] for g in held[n]) for n in held}
    mean_params = statistics.fmean(cfg["group_params"])

    def split(phase: str) -> tuple[dict[str, float], dict[str, float]]:
        """(one average group's share, the job slot's share) of ``phase``'s costs per update."""
        group, job = {}, {}
        for k in ("cpu_ms", "evalsha_usec", "xread_usec"):
            group[k] = statistics.fmean(cfg[phase][n][k] / len(held[n]) for n in pure)
            job[k] = cfg[phase][home][k] - len(held[home]) * group[k]
        for k in ("in_bytes", "out_bytes"):
            per_param = sum(cfg[phase][n][k] for n in pure) / sum(params[n] for n in pure)
            group[k] = per_param * mean_params
            job[k] = cfg[phase][home][k] - params[home] * per_param
        return group, job

    (gp, pj), (ga, aj) = split("push_per_update"), split("apply_per_update")
    return {
        "job_node_shared_with_groups": len(held[home]),
        "job_slot": {"cpu_ms": pj["cpu_ms"] + aj["cpu_ms"], "push_cpu_ms": pj["cpu_ms"], "apply_cpu_ms": aj["cpu_ms"],
                     "push_lua_us": pj["evalsha_usec"], "account_lua_us": aj["evalsha_usec"],
                     "xread_us": aj["xread_usec"], "in_bytes": pj["in_bytes"] + aj["in_bytes"],
                     "out_bytes": pj["out_bytes"] + aj["out_bytes"]},
        "per_group": {"cpu_ms": gp["cpu_ms"] + ga["cpu_ms"], "apply_lua_us": ga["evalsha_usec"],
                      "in_bytes": gp["in_bytes"] + ga["in_bytes"], "out_bytes": gp["out_bytes"] + ga["out_bytes"]},
        "ps_cpu_ms": {"mean": statistics.fmean(cfg["ps_cpu_ms_per_update"]), "max": max(cfg["ps_cpu_ms_per_update"]),
                      "sum": sum(cfg["ps_cpu_ms_per_update"])},
    }


def show(result: dict) -> None:
    kb = 1024
    for cfg in result["configs"]:
        where = ", ".join(f"g{p['group']} slot {p['slot']} on {p['node']}" for p in cfg["placement"]["groups"])
        sizes = ", ".join(f"{n / 1e6:.2f}M" for n in cfg["group_params"])
        alone = "alone" if not cfg["summary"]["job_node_shared_with_groups"] else "with a group"
        print(f"{cfg['groups']} group(s): job slot {cfg['placement']['job']['slot']} on {cfg['job_node']} ({alone}); "
              f"{where}; params per group {sizes}")
    t = result["configs"][0]["trainer_per_update"]
    print(f"per update, trainer: encode {t['encode_cpu_ms']:.2f} ms CPU, push {t['push_cpu_ms']:.2f} ms CPU "
          f"(wall {t['wall_ms']:.2f} ms with encode), {t['wire_bytes'] / kb:.1f} KB encoded "
          f"({t['raw_bytes'] / t['wire_bytes']:.0f}x < fp32)")
    for cfg in result["configs"]:
        s = cfg["summary"]
        j, g, ps = s["job_slot"], s["per_group"], s["ps_cpu_ms"]
        est = " (est.: its master holds a group)" if s["job_node_shared_with_groups"] else ""
        print(f"per update, {cfg['groups']} group(s): job slot{est} {j['cpu_ms']:.3f} ms Redis CPU (push "
              f"{j['push_cpu_ms']:.3f}: push.lua {j['push_lua_us']:.0f} us; apply phase {j['apply_cpu_ms']:.3f}: "
              f"account.lua {j['account_lua_us']:.0f} us, XREAD {j['xread_us']:.0f} us), "
              f"{j['in_bytes'] / kb:.1f} KB in, {j['out_bytes'] / kb:.1f} KB out")
        print(f"per update, {cfg['groups']} group(s): each group's slot {g['cpu_ms']:.3f} ms Redis CPU (apply.lua "
              f"{g['apply_lua_us']:.0f} us), {g['in_bytes'] / kb:.1f} KB in; each ps process {ps['mean']:.2f} ms CPU "
              f"(max {ps['max']:.2f}, all groups {ps['sum']:.2f})")
    for cfg in result["configs"]:
        p = cfg["pulls"]
        burst = next(k for k in p if k.startswith("delta_after_") and k != "delta_after_1")
        full, one, many = p["full"], p["delta_after_1"], p[burst]
        print(f"per pull, {cfg['groups']} group(s): full {full['wire_bytes'] / kb:.0f} KB ({full['client_cpu_ms']:.2f} "
              f"ms client, {full['redis_cpu_ms']:.2f} ms Redis); delta after 1 update {one['wire_bytes'] / kb:.0f} KB "
              f"({one['client_cpu_ms']:.2f} ms client, {one['redis_cpu_ms']:.3f} ms Redis); after {burst[12:]} "
              f"{many['wire_bytes'] / kb:.0f} KB ({many['redis_cpu_ms']:.3f} ms Redis); SSP clock read "
              f"{p['clock_read']['redis_cpu_ms'] * 1e3:.0f} us Redis")
    r = result["records"]
    print(f"per record ({r['records']} records, 784 float32 features, shards of {r['shard_records']}): "
          f"{r['bytes_per_record']:.0f} bytes, producer encode {r['encode_us_per_record']:.2f} us, "
          f"consumer decode {r['decode_us_per_record']:.2f} us CPU")
    k = result.get("kafka")
    if k:
        pr, co = k["produce"], k["consume"]
        print(f"per record through Kafka ({k['records']} records): broker {pr['broker_cpu_us_per_record']:.1f} us CPU "
              f"to take it (idempotent, acks=all), {co['broker_cpu_us_per_record']:.1f} us to serve it; producer "
              f"{pr['producer_cpu_us_per_record']:.1f} us, consumer {co['consumer_cpu_us_per_record']:.1f} us "
              f"({pr['records_per_s']:,.0f} records/s in, {co['records_per_s']:,.0f} out)")
    for cfg in result["configs"]:
        rounds = ", ".join(f"{x['updates_per_s']:.0f}" for x in cfg["rounds"])
        best = max(cfg["rounds"], key=lambda x: x["updates_per_s"])
        print(f"apply throughput, {cfg['groups']} group(s) ({cfg['groups']} ps processes): "
              f"{cfg['updates_per_s']:.0f} updates/s applied and accounted (rounds: {rounds}; Redis and ps busy "
              f"{best['cores_busy']:.2f} of {os.cpu_count()} cores in the best)")
    print(f"machine: {os.cpu_count()} cores shared by 3 Redis masters, the ps processes and this script: "
          "what counts is that nothing serialises on one node, not the absolute figures")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--updates", type=int, default=960, help="updates pushed, then applied, per round")
    parser.add_argument("--rounds", type=int, default=3, help="timed rounds per group count; the best counts")
    parser.add_argument("--groups", default="1,2,4", help="group counts to measure (comma-separated)")
    parser.add_argument("--pulls", type=int, default=20, help="measured pulls of each kind")
    parser.add_argument("--burst", type=int, default=8, help="updates applied before the second delta pull")
    parser.add_argument("--records", type=int, default=8192, help="records encoded and decoded in memory")
    parser.add_argument("--kafka-records", type=int, default=20000, help="records through the broker")
    parser.add_argument("--no-kafka", action="store_true", help="skip the broker measurement")
    args = parser.parse_args(argv)
    group_counts = [int(g) for g in args.groups.split(",")]
    if min(group_counts) < 1 or args.updates < 1 or args.rounds < 1:
        parser.error("--groups, --updates and --rounds must be >= 1")
    harness.start()
    logging.getLogger("kafka").setLevel(logging.ERROR)  # kafka-python warns of its own slow event loop here
    torch.set_num_threads(1)  # a trainer's encode, single-threaded: CPU time per update, not spinning threads
    tensors = {n: p.detach().clone() for n, p in build_model(MODEL).model.named_parameters()}
    result: dict = {"model": MODEL, "params": sum(t.numel() for t in tensors.values()),
                    "codec": CoordinatorSettings().codec, "density": TrainerSettings().topk_density,
                    "optimizer": CoordinatorSettings().optimizer, "lr": CoordinatorSettings().lr,
                    "servers": "one `streamtrain ps --groups G --group g` process per group",
                    "updates": args.updates, "rounds": args.rounds, "configs": []}
    with RedisCluster(masters=3) as cluster:
        result["redis_server"] = redis_version()
        client = connect(cluster.url)
        masters = Masters(cluster, client)
        try:
            for groups in group_counts:
                result["configs"].append(throughput(cluster, client, masters, tensors, groups, args))
        finally:
            masters.close()
            client.close()
    result["records"] = record_costs(args.records)
    result["kafka"] = None if args.no_kafka else kafka_costs(args.kafka_records, warmup=args.kafka_records // 4)
    rates = {c["groups"]: c["updates_per_s"] for c in result["configs"]}
    lo, hi = min(rates), max(rates)
    result["ratio"] = {"groups": [hi, lo], "value": rates[hi] / rates[lo]}
    show(result)
    harness.finish("scale", result,
                   [f"ratio apply {hi} groups / {lo} group{'s' if lo > 1 else ''}: {rates[hi] / rates[lo]:.2f}"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
