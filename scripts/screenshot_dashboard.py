"""Screenshot the coordinator's dashboard during a real local run (for docs/img/dashboard.png).

Starts the local topology (Kafka, Redis, coordinator, parameter server,
producer, trainers: :class:`streamtrain.cluster.LocalCluster`), lets it train
for ``--seconds``, opens the coordinator's page in headless Chromium with the
DevTools helper of the tests (``tests/cdp.py``), and writes a PNG::

    .venv/bin/python scripts/screenshot_dashboard.py --seconds 40 --out docs/img/dashboard.png
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

root = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(root / "tests"))

from cdp import chromium

from streamtrain.cluster import LOCAL_STREAM, ClusterSpec, LocalCluster


async def shoot(url: str, out: Path) -> None:
    with tempfile.TemporaryDirectory(prefix="dashboard-shot-") as tmp:
        async with chromium(Path(tmp) / "profile", width=1400, height=1000) as page:
            await page.navigate(url)
            await page.wait_for("window.plots && Object.keys(window.plots).length === 7 && "
                                "Object.values(window.plots).every(u => u.data[0].length > 3)")
            await asyncio.sleep(2)  # the tables' second refresh
            errors = page.errors()
            if errors:
                raise SystemExit(f"the page reported errors: {errors}")
            out.parent.mkdir(parents=True, exist_ok=True)
            out.write_bytes(await page.screenshot())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=40.0, help="training time before the screenshot")
    parser.add_argument("--trainers", type=int, default=2)
    parser.add_argument("--source", default=LOCAL_STREAM.source, help="what the producer streams")
    parser.add_argument("--rate", type=float, default=None, help="records/s the producer stays under")
    parser.add_argument("--out", type=Path, default=root / "docs" / "img" / "dashboard.png")
    args = parser.parse_args()
    spec = ClusterSpec(trainers=args.trainers, producer=replace(LOCAL_STREAM, source=args.source, rate=args.rate))
    cluster = LocalCluster(spec)
    try:
        with cluster:
            print(f"coordinator at {cluster.coordinator_url}; training for {args.seconds:.0f}s", flush=True)
            time.sleep(args.seconds)
            asyncio.run(shoot(cluster.coordinator_url + "/", args.out))
    finally:
        cluster.cleanup()
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
