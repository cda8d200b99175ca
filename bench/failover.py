"""Redis Cluster failover: how many acknowledged writes the promoted replica lacks, and what ``WAIT`` costs.

For each trial it starts a Redis Cluster of three masters with a replica each
(:class:`streamtrain.launcher.RedisCluster`), runs ``--writers`` threads that
INCR their own counter in one slot on its master (each reply awaited; with
``WAIT 1 100`` after each INCR in the second half), SIGKILLs that master after
``--run-s``, waits for its replica's promotion and compares each counter there
with the last value its writer saw acknowledged. Prints one line per trial: the
acknowledged INCRs lost (negative: kept writes whose reply died with the master)
and the rate. Writes ``bench/results/failover.json``; prints the acknowledged INCRs
lost in all, without and with ``WAIT``, last. See ``docs/parameter-plane.md`` (Failover).

    .venv/bin/python bench/failover.py [--trials 3] [--writers 1 8] [--run-s 1.0]
"""

from __future__ import annotations

import argparse
import sys
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a file: the repository first (bench.harness)

import redis

from bench import harness
from common.redis_client import connect
from streamtrain.launcher import RedisCluster, wait_until

SLOT = "{failover}"
"""The hash tag of every counter: one slot, one master."""


def trial(writers: int, wait: bool, run_s: float) -> tuple[int, int, float]:
    """(acknowledged INCRs lost, acknowledged INCRs, INCRs/s) of one failover."""
    with RedisCluster(replicas=1) as rc:
        master = rc.master_of(SLOT)
        acked = [0] * writers
        stop = threading.Event()

        def write(i: int) -> None:
            client = redis.Redis(host=master.host, port=master.port, password=rc.password, socket_timeout=2.0)
            while not stop.is_set():
                try:
                    n = client.incr(f"{SLOT}c{i}")
                    if wait:
                        client.execute_command("WAIT", 1, 100)
                    acked[i] = n
                except redis.RedisError:
                    return

        threads = [threading.Thread(target=write, args=(i,)) for i in range(writers)]
        for t in threads:
            t.start()
        time.sleep(run_s)
        killed = rc.kill_master_of(SLOT).address
        stop.set()
        for t in threads:
            t.join()
        wait_until(lambda: rc.master_of(SLOT).address != killed, 60, what="the replica promoted")
        client = connect(rc.url)
        try:
            kept = [int(client.get(f"{SLOT}c{i}") or 0) for i in range(writers)]
        finally:
            client.close()
        return sum(a - k for a, k in zip(acked, kept, strict=True)), sum(acked), sum(acked) / run_s


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=3, help="failovers per setting")
    parser.add_argument("--writers", type=int, nargs="+", default=[1, 8], help="writer threads")
    parser.add_argument("--run-s", type=float, default=1.0, help="seconds of writes before the kill")
    args = parser.parse_args()
    harness.start()
    trials: list[dict[str, Any]] = []
    for wait in (False, True):
        for writers in args.writers:
            for _ in range(args.trials):
                lost, total, rate = trial(writers, wait, args.run_s)
                trials.append({"wait": wait, "writers": writers, "lost": lost, "acknowledged": total,
                               "incr_per_s": rate})
                print(f"WAIT={'1' if wait else '-'} writers={writers}: {lost} of {total} acknowledged INCRs lost "
                      f"({rate:,.0f}/s)", flush=True)
    totals = {wait: (sum(t["lost"] for t in trials if t["wait"] == wait),
                     sum(t["acknowledged"] for t in trials if t["wait"] == wait)) for wait in (False, True)}
    summary = (f"acknowledged INCRs lost in all: {totals[False][0]} of {totals[False][1]} without WAIT, "
               f"{totals[True][0]} of {totals[True][1]} with WAIT 1")
    harness.finish("failover", {"run_s": args.run_s, "trials": trials}, [summary])


if __name__ == "__main__":
    main()
