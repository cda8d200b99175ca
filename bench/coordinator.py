"""Control-plane benchmark: how long after a lease expires its partitions are reassigned.

Against one ``redis-server`` on loopback, runs the coordinator in-process on a
free port and, for each round, registers ``--members`` trainers through
:class:`coordinator.CoordinatorClient`, keeps all but one heartbeating every
``heartbeat_interval_ms``, and stops the last. It records, from Redis:

- **expiry -> reassignment**: from the victim's ``lease_expires_ms`` to the
  first poll (every 2 ms) that sees ``JobKeys.assignment`` without it at a new
  generation (the lease checker wakes at the soonest lease expiry, at most a
  period of lease/4 apart, and reassigns in one CAS; includes the 2 ms poll);
- **last heartbeat -> reassignment**: the same from its last heartbeat (the
  lease plus the above): what a trainer crash costs before its partitions
  move.

It also measures heartbeat round trips with all members heartbeating
concurrently. Writes ``bench/results/coordinator.json`` and prints the ratio of
the median expiry -> reassignment delay to the checker period last.

    .venv/bin/python bench/coordinator.py [--rounds 5] [--lease-ms 3000] [--members 4]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any, cast

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a file: the repository first (bench.harness)

import redis
from aiohttp import web

from bench import harness
from common.keys import JobKeys
from coordinator import CoordinatorClient, CoordinatorSettings
from coordinator.app import create_app
from coordinator.state import parse_assignment
from streamtrain.launcher import RedisServer, free_port


async def one_round(url: str, r: redis.Redis, keys: JobKeys, members: int,
                    interval_s: float) -> dict[str, float]:
    clients = [CoordinatorClient(url, "bench-job") for _ in range(members)]
    try:
        regs = [await c.register({"device": "cpu", "threads": 2}) for c in clients]
        victim = regs[-1].member_id
        stop = asyncio.Event()
        rtts: list[float] = []

        async def beat(c: CoordinatorClient) -> None:
            while not stop.is_set():
                t = time.perf_counter()
                await c.heartbeat({"records_per_s": 1.0})
                rtts.append(time.perf_counter() - t)
                await asyncio.sleep(interval_s)

        tasks = [asyncio.create_task(beat(c)) for c in clients[:-1]]
        await clients[-1].heartbeat({})
        last_beat_ms = time.time() * 1000
        gen = int(cast(bytes, r.get(keys.generation)))
        expires_ms = json.loads(cast(bytes, r.hget(keys.members, victim)))["lease_expires_ms"]
        while True:
            owners = parse_assignment(r.hgetall(keys.assignment))
            if all(m != victim and g > gen for m, g in owners.values()):
                seen_ms = time.time() * 1000
                break
            await asyncio.sleep(0.002)
        stop.set()
        await asyncio.gather(*tasks)
        for c in clients[:-1]:
            await c.leave()
        return {"expiry_to_reassign_ms": seen_ms - expires_ms,
                "last_heartbeat_to_reassign_ms": seen_ms - last_beat_ms,
                "heartbeat_rtt_ms_median": statistics.median(rtts) * 1000 if rtts else float("nan")}
    finally:
        for c in clients:
            await c.close()


async def main_async(args: argparse.Namespace) -> dict[str, Any]:
    with RedisServer() as server:
        settings = CoordinatorSettings(
            job="bench", redis_url=server.url, kafka_bootstrap=f"127.0.0.1:{free_port()}",
            partitions=12, lease_ms=args.lease_ms, heartbeat_interval_ms=args.lease_ms // 6,
            admin_token="bench-admin", job_token="bench-job", port=free_port())
        runner = web.AppRunner(create_app(settings), access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", settings.port)
        await site.start()
        r = redis.Redis.from_url(server.url)
        try:
            url = f"http://127.0.0.1:{settings.port}"
            rounds = [await one_round(url, r, JobKeys("bench"), args.members,
                                      settings.heartbeat_interval_ms / 1000)
                      for _ in range(args.rounds)]
        finally:
            r.close()
            await runner.cleanup()
    expiry = [x["expiry_to_reassign_ms"] for x in rounds]
    return {
        "lease_ms": args.lease_ms, "check_interval_ms": args.lease_ms / 4,
        "members": args.members, "rounds": rounds,
        "expiry_to_reassign_ms": {"median": statistics.median(expiry), "max": max(expiry),
                                  "min": min(expiry)},
        "last_heartbeat_to_reassign_ms_median": statistics.median(
            x["last_heartbeat_to_reassign_ms"] for x in rounds),
        "ratio_expiry_delay_to_check_interval": statistics.median(expiry) / (args.lease_ms / 4),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--lease-ms", type=int, default=3000)
    parser.add_argument("--members", type=int, default=4)
    args = parser.parse_args()
    harness.start()
    result = asyncio.run(main_async(args))
    e = result["expiry_to_reassign_ms"]
    print(f"lease {args.lease_ms} ms, checker every {args.lease_ms / 4:.0f} ms, "
          f"{args.members} members, {args.rounds} rounds")
    print(f"expiry -> reassignment: median {e['median']:.0f} ms (min {e['min']:.0f}, "
          f"max {e['max']:.0f})")
    print(f"last heartbeat -> reassignment: median "
          f"{result['last_heartbeat_to_reassign_ms_median']:.0f} ms")
    harness.finish("coordinator", result,
                   [f"ratio expiry delay / checker period: {result['ratio_expiry_delay_to_check_interval']:.2f}"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
