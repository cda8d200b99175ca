"""Parameter-plane benchmark: push/pull bandwidth against raw redis-py, apply rate, codec sizes.

In one run, against one ``redis-server`` started on loopback:

1. **Client paths.** A 4 MB SET/GET, MGETs of 64 x 64 KB and 40 x 1 MB values
   with redis-py's own packer and parser, with the hiredis packer and parser,
   and with ``services.connect`` (redis-py's packer, hiredis's parser): the
   numbers behind declaring hiredis and overriding its packer.
2. **Push and pull bandwidth** of a 10M-parameter model (40 MB of float32 in
   1 MiB shards, one shard group): ``push_update`` (the shards' encoded gradients
   SET in one MULTI per group slot, then one Lua script: fencing, offset commit,
   the log entry) against a raw pipeline of SETs of the same bytes, both into new
   keys (like-for-like: every pushed update is new data; Redis then maps fresh
   memory) and overwriting the same keys (Redis reuses the freed memory, ~2x
   faster at 40 MB), and ``ParameterStore.pull`` (per group, a MULTI/EXEC of its
   version and an MGET of its shards plus their deltas, into the trainer's
   parameter tensors with ``out=``) against a raw MGET of the same keys; a pull
   into fresh tensors is reported too.
3. **Updates applied per second** by one parameter server, and the bytes Redis
   received per update meanwhile: dense fp32 gradients with SGD and momentum for
   1M- and 10M-parameter models (every update changes every value: full writes);
   and the pipeline's 1.86M-parameter MLP (784-1024-1024-10) with topk+fp16 at 1%
   and ``--pending`` updates per write, for ``lazyadam`` and ``dgc`` (deltas of the
   coordinates changed) and dense ``adam`` (every coordinate moves: full writes);
   ``lazyadam`` again against a Redis with AOF on (``appendfsync everysec``).
4. **Bytes a pull moves per step** for that MLP with one trainer (each update applied
   before the next pull), sparse against dense Adam.
5. **Bytes per step** of each codec against fp32 for a 10M-value gradient.

Each timing is the best of ``--rounds``. Writes ``bench/results/paramserver.json``
and prints the ratios, the push/pull ratio last.

    .venv/bin/python bench/paramserver.py [--rounds 5]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import cast

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a file: the repository first (bench.harness)

import redis
import torch

from bench import harness
from common.keys import JobKeys
from services import (
    OptimizerConfig,
    ParameterServer,
    ParameterStore,
    Pusher,
    ServerSettings,
    Update,
    connect,
    get_codec,
    push_update,
)
from services.protocol import group_of
from streamtrain.launcher import RedisServer

MB = 1024 * 1024


def best(fn: Callable[[], object], rounds: int, setup: Callable[[], object] | None = None) -> float:
    """Best wall time of ``fn`` over ``rounds`` (``setup`` runs untimed before each)."""
    times = []
    for _ in range(rounds):
        if setup:
            setup()
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return min(times)


def paired(ours: Callable[[], object], raw: Callable[[], object], rounds: int,
           setup: Callable[[], object] | None = None) -> tuple[float, float]:
    """Best times of ``ours`` and ``raw``, run alternately so that machine noise hits both alike."""
    t_ours: list[float] = []
    t_raw: list[float] = []
    for _ in range(rounds):
        for fn, times in ((ours, t_ours), (raw, t_raw)):
            if setup:
                setup()
            t = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t)
    return min(t_ours), min(t_raw)


def client_paths(url: str, rounds: int) -> dict:
    """4 MB SET/GET, MGET of 64 x 64 KB vs 64 GETs and MGET of 40 x 1 MB, per client path:
    ``python`` (redis-py's packer and parser), ``hiredis`` (redis-py's default when hiredis is
    installed: hiredis packer and parser) and ``ours`` (:func:`services.connect`: redis-py's
    packer, hiredis's parser when installed)."""
    from redis._parsers import _RESP2Parser
    from redis.connection import HIREDIS_AVAILABLE

    out: dict = {"hiredis_installed": HIREDIS_AVAILABLE}
    paths = {"python": connect(url, parser_class=_RESP2Parser)}
    if HIREDIS_AVAILABLE:
        paths["hiredis"] = redis.Redis.from_url(url)
        paths["ours"] = connect(url)
    big = bytes(bytearray(range(256)) * (4 * MB // 256))
    small = [bytes([i]) * (64 * 1024) for i in range(64)]
    ops = {"set_4mb_ms": lambda c: c.set("bench:big", big), "get_4mb_ms": lambda c: c.get("bench:big"),
           "mget_64x64kb_ms": lambda c: c.mget([f"bench:s{i}" for i in range(64)]),
           "get_64x64kb_ms": lambda c: [c.get(f"bench:s{i}") for i in range(64)],
           "mget_40x1mb_ms": lambda c: c.mget([f"bench:m{i}" for i in range(40)])}
    times: dict[str, dict[str, list[float]]] = {name: {op: [] for op in ops} for name in paths}
    for client in paths.values():
        client.set("bench:big", big)
        client.mset({f"bench:s{i}": v for i, v in enumerate(small)})
        client.mset({f"bench:m{i}": big[:MB] for i in range(40)})
    for _ in range(rounds * 4):  # the paths alternate, so machine noise hits both alike
        for op, fn in ops.items():
            for name, client in paths.items():
                t = time.perf_counter()
                fn(client)
                times[name][op].append(time.perf_counter() - t)
    for name, client in paths.items():
        out[name] = {op: min(ts) * 1e3 for op, ts in times[name].items()}
        client.close()
    if "hiredis" in out:
        out["hiredis_set_slowdown"] = out["hiredis"]["set_4mb_ms"] / out["python"]["set_4mb_ms"]
        out["hiredis_get_speedup"] = out["python"]["get_4mb_ms"] / out["hiredis"]["get_4mb_ms"]
        out["hiredis_mget_40x1mb_speedup"] = out["python"]["mget_40x1mb_ms"] / out["hiredis"]["mget_40x1mb_ms"]
    mine = out["ours" if "ours" in out else "python"]
    out["mget_vs_gets"] = mine["get_64x64kb_ms"] / mine["mget_64x64kb_ms"]
    return out


def model(numel: int) -> dict[str, torch.Tensor]:
    """A model of ``numel`` float32 parameters in four tensors."""
    q = numel // 4
    return {"l1.weight": torch.randn(q, 2), "l1.bias": torch.randn(q), "l2.weight": torch.randn(q)}


def job_keys(client: redis.Redis, job: str) -> list[bytes]:
    """Every key of ``job``: its slot's and each of its shard groups' (the server's Redis is one node)."""
    keys = JobKeys(job)
    groups = ParameterStore(client, job).meta().groups
    found = [*client.keys(keys.key("*")), *(k for g in range(groups) for k in client.keys(keys.group(g).key("*")))]
    return cast("list[bytes]", found)


def membership(client: redis.Redis, job: str) -> None:
    keys = JobKeys(job)
    client.set(keys.generation, 1)
    client.hset(keys.members, "bench", "{}")
    client.hset(keys.assignment, "0", "bench|1")


def push_pull(url: str, rounds: int) -> dict:
    """Push and pull of a 10M-parameter model vs raw SET/MGET of the same bytes."""
    client = connect(url)
    job = "bench-pp"
    store = ParameterStore(client, job)
    store.init_model(model(10_000_000), optimizer=OptimizerConfig(momentum=0.0))
    membership(client, job)
    keys = JobKeys(job)
    layout = store.layout
    codec = get_codec("none")
    blobs = {s.index: codec.encode(torch.randn(s.numel)).data for s in layout.shards}
    nbytes = sum(len(b) for b in blobs.values())
    clock = [0]

    def push() -> None:
        clock[0] += 1
        c = clock[0]
        push_update(client, job, Update(member_id="bench", generation=1, clock=c, gradients=blobs,
                                        offsets={0: (c - 1, c)}))

    def raw_set(prefix: str = "raw") -> None:
        pipe = client.pipeline(transaction=False)
        for i, b in blobs.items():
            pipe.set(f"{prefix}:{i}", b)
        pipe.execute()

    groups = store.meta().groups
    blobs_of = [keys.group(g).update_blob("*", "*") for g in range(groups)]

    def clear_log() -> None:  # what the servers do once an update is applied
        client.delete(keys.update_log, keys.unapplied, *(k for b in blobs_of for k in client.keys(b)),
                      *client.keys("fresh:*"))

    shard_keys = [keys.group(group_of(s.index, groups)).shard(s.index) for s in layout.shards]  # one group: one MGET
    push_s, set_s = paired(push, raw_set, rounds, clear_log)
    _, fresh_s = paired(lambda: None, lambda: raw_set("fresh"), rounds, clear_log)
    params = {k: v.clone() for k, v in store.pull().tensors.items()}
    pull_s, mget_s = paired(lambda: store.pull(out=params), lambda: client.mget(shard_keys), rounds)
    alloc_s = best(store.pull, rounds)
    snap = store.pull()
    unchanged_s = best(lambda: store.pull(since=snap), rounds)
    client.delete(keys.update_log)
    client.close()
    return {"params": layout.numel, "bytes": nbytes, "shards": len(layout.shards),
            "push_MBps": nbytes / push_s / MB, "raw_set_MBps": nbytes / set_s / MB,
            "pull_MBps": nbytes / pull_s / MB, "raw_mget_MBps": nbytes / mget_s / MB,
            "pull_unchanged_ms": unchanged_s * 1e3, "pull_new_tensors_MBps": nbytes / alloc_s / MB,
            "raw_set_new_keys_MBps": nbytes / fresh_s / MB,
            "push_ratio": set_s / push_s, "push_ratio_new_keys": fresh_s / push_s, "pull_ratio": mget_s / pull_s}


def mlp() -> dict[str, torch.Tensor]:
    """The pipeline benchmark's 784-1024-1024-10 MLP (1.86M parameters)."""
    dims = [784, 1024, 1024, 10]
    out = {}
    for j, (a, b) in enumerate(zip(dims, dims[1:]), start=1):
        out[f"l{j}.weight"] = torch.randn(b, a) * a ** -0.5
        out[f"l{j}.bias"] = torch.zeros(b)
    return out


def apply_rate(url: str, tensors: dict[str, torch.Tensor], updates: int, batch: int, *,
               optimizer: OptimizerConfig, codec: str, density: float = 0.01) -> dict:
    """Updates/s one server applies, synchronously, reading up to ``batch`` pending updates per write,
    and the bytes Redis received per update while it did (deltas, compactions, persists, accounting)."""
    client = connect(url)
    job = f"bench-apply-{sum(t.numel() for t in tensors.values())}-{optimizer.name}-{codec.replace('+', '_')}-{batch}"
    store = ParameterStore(client, job)
    threads = torch.get_num_threads()
    store.init_model(tensors, optimizer=optimizer)
    membership(client, job)
    enc = get_codec(codec, density=density) if codec.startswith("topk") else get_codec(codec)
    gen = torch.Generator().manual_seed(0)
    for c in range(1, updates + 1):  # every update a new gradient: the coordinates top-k keeps differ
        blobs = {s.index: enc.encode(torch.randn(s.numel, generator=gen) * 1e-3).data for s in store.layout.shards}
        push_update(client, job, Update(member_id="bench", generation=1, clock=c, gradients=blobs,
                                        offsets={0: (c - 1, c)}), max_pending=updates + 1)
    settings = ServerSettings(redis_url=url, job=job, block_ms=1, batch=batch)
    torch.set_num_threads(settings.torch_threads)  # as `streamtrain ps` does
    server = ParameterServer(settings, client=client)
    server.load()
    received = client.info("stats")["total_net_input_bytes"]
    t = time.perf_counter()
    while server.applied < updates:
        server.step()
    elapsed = time.perf_counter() - t
    received = client.info("stats")["total_net_input_bytes"] - received
    assert int(cast(bytes, client.hget(JobKeys(job).applied_clocks, "bench"))) == updates
    assert store.version() == -(-updates // batch)  # one version of the job's one group per write
    torch.set_num_threads(threads)
    client.delete(*job_keys(client, job))
    client.close()
    return {"params": store.layout.numel, "optimizer": optimizer.name, "codec": codec, "updates": updates,
            "batch": batch, "updates_per_s": updates / elapsed, "redis_bytes_per_update": received / updates}


def pull_bytes(url: str, tensors: dict[str, torch.Tensor], steps: int, *, optimizer: OptimizerConfig,
               codec: str = "topk+fp16", density: float = 0.01) -> dict:
    """Bytes a trainer's pull moves per step when every step's update is applied before the next
    pull (SSP with one trainer): what changed, against the model's full float32 bytes."""
    client = connect(url)
    job = f"bench-pull-{optimizer.name}"
    store = ParameterStore(client, job)
    store.init_model(tensors, optimizer=optimizer)
    membership(client, job)
    pusher = Pusher(client, job, "bench", codec=codec, codec_options={"density": density})
    server = ParameterServer(ServerSettings(redis_url=url, job=job, block_ms=1, batch=1), client=client)
    server.load()
    out = {n: t.clone() for n, t in tensors.items()}
    snap = store.pull(out=out)
    gen = torch.Generator().manual_seed(1)
    moved, times = [], []
    for c in range(1, steps + 1):
        pusher.push({n: torch.randn(t.shape, generator=gen) for n, t in tensors.items()}, generation=1, clock=c,
                    offsets={0: (c - 1, c)})
        server.step()
        t = time.perf_counter()
        snap = store.pull(snap, out=out)
        times.append(time.perf_counter() - t)
        moved.append(snap.wire_bytes)
    full = 4 * store.layout.numel
    client.delete(*job_keys(client, job))
    client.close()
    return {"optimizer": optimizer.name, "codec": codec, "density": density, "model_bytes": full,
            "bytes_per_pull": statistics.fmean(moved), "fraction_of_model": statistics.fmean(moved) / full,
            "pull_ms": statistics.median(times) * 1e3}


def codec_sizes(numel: int) -> dict:
    """Wire bytes per step of each codec for a ``numel``-value gradient, and x smaller than fp32."""
    grad = torch.randn(numel)
    out = {}
    fp32 = None
    for name in ("none", "fp16", "bf16", "int8", "topk", "topk+fp16", "topk+int8"):
        codec = get_codec(name, density=0.01) if name.startswith("topk") else get_codec(name)
        t = time.perf_counter()
        enc = codec.encode(grad)
        encode_ms = (time.perf_counter() - t) * 1e3
        fp32 = fp32 or enc.nbytes
        out[name] = {"bytes": enc.nbytes, "x_smaller": fp32 / enc.nbytes, "encode_ms": encode_ms}
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=5, help="timed repetitions; the best counts")
    parser.add_argument("--updates", type=int, default=20, help="updates per dense apply-rate measurement")
    parser.add_argument("--pending", type=int, default=16,
                        help="pending updates applied per write in the sparse apply measurements")
    parser.add_argument("--sparse-updates", type=int, default=320, help="updates per sparse apply measurement")
    args = parser.parse_args(argv)
    harness.start()
    torch.manual_seed(0)
    net = mlp()
    lazy = OptimizerConfig(name="lazyadam", lr=1e-3)
    with RedisServer() as server:
        url = server.url
        paths = client_paths(url, args.rounds)
        pp = push_pull(url, args.rounds)
        sgd = OptimizerConfig(name="sgd", lr=0.01, momentum=0.9)
        dense = [apply_rate(url, model(n), args.updates, args.updates, optimizer=sgd, codec="none")
                 for n in (1_000_000, 10_000_000)]
        sparse = [apply_rate(url, net, args.sparse_updates, args.pending, optimizer=cfg, codec="topk+fp16")
                  for cfg in (lazy, OptimizerConfig(name="dgc", lr=0.1), OptimizerConfig(name="adam", lr=1e-3))]
        pulls = [pull_bytes(url, net, 30, optimizer=cfg)
                 for cfg in (lazy, OptimizerConfig(name="adam", lr=1e-3))]
    with RedisServer(appendonly=True) as server:  # AOF on, appendfsync everysec, as streamtrain up runs it
        aof = apply_rate(server.url, net, args.sparse_updates, args.pending, optimizer=lazy, codec="topk+fp16")
    torch.set_num_threads(1)  # encode times single-threaded: torch's 2 spinning threads are 2-3x slower on a shared box
    sizes = codec_sizes(10_000_000)
    result = {"client_paths": paths, "push_pull": pp, "apply_dense": dense, "apply_sparse": sparse,
              "apply_sparse_aof": aof, "pull_bytes": pulls, "codecs": sizes}

    for name in ("python", "hiredis", "ours"):
        if name in paths:
            c = paths[name]
            print(f"client {name:<7}: 4 MB SET {c['set_4mb_ms']:.2f} ms, GET {c['get_4mb_ms']:.2f} ms; MGET 40x1MB "
                  f"{c['mget_40x1mb_ms']:.2f} ms; MGET 64x64KB {c['mget_64x64kb_ms']:.2f} ms vs 64 GETs "
                  f"{c['get_64x64kb_ms']:.2f} ms")
    if "hiredis" in paths:
        print(f"hiredis: packer {paths['hiredis_set_slowdown']:.2f}x slower on a 4 MB SET; parser "
              f"{paths['hiredis_get_speedup']:.2f}x faster on a 4 MB GET, {paths['hiredis_mget_40x1mb_speedup']:.2f}x "
              "on MGET 40x1MB -> services.connect uses redis-py's packer with hiredis's parser")
    else:
        print("hiredis: not installed, path not measured")
    print(f"MGET of 64 x 64 KB vs 64 GETs: {paths['mget_vs_gets']:.1f}x")
    for r in dense:
        print(f"apply: {r['params'] / 1e6:.1f}M params, dense fp32, SGD momentum, {r['batch']} per write: "
              f"{r['updates_per_s']:.1f} updates/s, {r['redis_bytes_per_update'] / MB:.2f} MB into Redis per update")
    for r in sparse:
        print(f"apply: 1.86M MLP, topk+fp16 at 1%, {r['optimizer']:<8}, {args.pending} pending per write: "
              f"{r['updates_per_s']:.1f} updates/s, {r['redis_bytes_per_update'] / 1024:.0f} KB into Redis per update")
    print(f"apply with AOF on (appendfsync everysec), lazyadam: {aof['updates_per_s']:.1f} updates/s "
          f"({aof['updates_per_s'] / sparse[0]['updates_per_s']:.2f} of the rate without)")
    for r in pulls:
        print(f"pull per step, 1.86M MLP, topk+fp16 at 1%, {r['optimizer']:<8}: {r['bytes_per_pull']:,.0f} bytes "
              f"({r['fraction_of_model']:.1%} of the {r['model_bytes'] / MB:.2f} MB model), {r['pull_ms']:.2f} ms")
    for name, s in sizes.items():
        print(f"codec {name:<10} {s['bytes']:>11,} bytes/step  {s['x_smaller']:7.1f}x smaller than fp32  "
              f"(encode {s['encode_ms']:.1f} ms)")
    print(f"push {pp['push_MBps']:.0f} MB/s vs raw SET {pp['raw_set_MBps']:.0f} MB/s overwriting the same keys, "
          f"{pp['raw_set_new_keys_MBps']:.0f} MB/s into new keys (as every appended update must); "
          f"pull {pp['pull_MBps']:.0f} MB/s vs raw MGET {pp['raw_mget_MBps']:.0f} MB/s "
          f"({pp['params'] / 1e6:.0f}M params, {pp['shards']} shards); into fresh tensors "
          f"{pp['pull_new_tensors_MBps']:.0f} MB/s; unchanged pull {pp['pull_unchanged_ms']:.2f} ms")
    print(f"topk+fp16 at 1% density: {sizes['topk+fp16']['x_smaller']:.1f}x smaller than fp32 (target >= 100x)")
    print(f"applies/s, 1.86M MLP, topk+fp16 1%: {sparse[0]['updates_per_s']:.0f} (lazyadam, the job default; "
          f"dgc {sparse[1]['updates_per_s']:.0f}; dense adam {sparse[2]['updates_per_s']:.0f})")
    ratio = (f"push/pull vs raw redis-py SET/GET: push {pp['push_ratio_new_keys']:.2f} vs SET into new keys "
             f"({pp['push_ratio']:.2f} vs SET overwriting the same keys)  pull {pp['pull_ratio']:.2f} (target >= 0.80)")
    harness.finish("paramserver", result, [ratio])
    return 0


if __name__ == "__main__":
    sys.exit(main())
