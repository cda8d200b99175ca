"""``streamtrain status``: print ``/v1/status`` of a running coordinator as tables."""

from __future__ import annotations

import argparse
import json
import os
import urllib.error
import urllib.request
from typing import Any

from rich.console import Console
from rich.table import Table

URL_ENV = "STREAMTRAIN_COORDINATOR_URL"
"""The variable ``--url`` defaults to (the trainers' too; ``streamtrain up``'s credentials file sets it)."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """``--url`` of the coordinator, ``--json`` for the raw document."""
    default = os.environ.get(URL_ENV, "http://127.0.0.1:8700")
    parser.add_argument("--url", default=default,
                        help=f"base URL of the coordinator (also {URL_ENV}) [default {default}]")
    parser.add_argument("--json", action="store_true", help="print the raw JSON")
    parser.add_argument("--timeout-s", type=float, default=5.0, help="HTTP timeout in seconds")


def fetch_status(url: str, timeout_s: float) -> dict[str, Any]:
    """GET ``<url>/v1/status``.

    Raises:
        OSError: the coordinator is unreachable or answered an error.
    """
    with urllib.request.urlopen(url.rstrip("/") + "/v1/status", timeout=timeout_s) as resp:
        return json.load(resp)


def _fmt(value: Any, digits: int = 4) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.{digits}g}"
    return str(value)


def _tables(status: dict[str, Any]) -> str:
    """``"  tables asp (s=8)"`` when the job gives its embedding tables a mode or bound of their
    own, else nothing (they follow the dense part's)."""
    cfg = status["config"]
    if cfg.get("table_consistency") is None and cfg.get("table_staleness") is None:
        return ""
    tables = status["staleness"]["tables"]
    return f"  tables {tables['consistency']} (s={tables['bound']})"


def _bytes(n: int) -> str:
    """``n`` bytes in binary units (``3.2 MiB``)."""
    size = float(n)
    for unit in ("B", "KiB", "MiB"):
        if size < 1024:
            return f"{n} B" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    return f"{size:.1f} GiB"


def embedding_tables(status: dict[str, Any]) -> Table | None:
    """The table of the job's embedding tables (rows, bytes and the servers' counters, summed over
    the shard groups), titled with the trainers' row cache hit rate; None for a dense model (or a
    coordinator that reports no ``tables``)."""
    tables = status.get("tables") or {}
    per_table = tables.get("per_table") or []
    if not per_table:
        return None
    rate = tables.get("row_cache_hit_rate")
    out = Table(title=f"embedding tables (row cache hit rate {'-' if rate is None else f'{rate:.1%}'})")
    for col in ("table", "rows", "bytes", "admitted", "dropped", "expired", "evicted"):
        out.add_column(col, justify="left" if col == "table" else "right")
    for t in per_table:
        out.add_row(t["name"], f"{t['rows']:,}", _bytes(t["bytes"]),
                    *(f"{t[k]:,}" for k in ("admitted", "dropped", "expired", "evicted")))
    return out


def render(status: dict[str, Any], console: Console) -> None:
    """Print the job summary, the members, the partitions and, when the model has some, its
    embedding tables."""
    cfg = status["config"]
    console.print(
        f"[bold]job {status['job']}[/bold]  generation {status['generation']}  "
        f"{cfg['consistency']} (s={cfg['staleness']}){_tables(status)}  lr {cfg['lr']}  codec {cfg['codec']}  "
        f"ps groups {cfg.get('ps_groups', 1)}"
        f"{'  [red]PAUSED[/red]' if cfg['paused'] else ''}\n"
        f"throughput {_fmt(status['throughput_records_per_s'])} records/s  "
        f"loss {_fmt(status['loss'])}  "
        + (f"held-out AUC {_fmt(status['auc'])}  log loss {_fmt(status.get('log_loss'))}  "
           if status.get("auc") is not None else "")
        + f"accuracy {_fmt(status['accuracy'])}  lag {status['lag']}  "
        f"versions {_fmt(status['versions']['min'])}..{_fmt(status['versions']['max'])}")
    members = Table(title="members")
    for col in ("member", "state", "device", "weight", "partitions", "records/s", "loss", "clock",
                "lag", "lease left ms"):
        members.add_column(col)
    for m in status["members"]:
        s = m["stats"]
        members.add_row(m["member_id"], m["state"], m["capabilities"].get("device", "?"),
                        _fmt(m["weight"], 3), ",".join(map(str, m["partitions"])),
                        _fmt(s.get("records_per_s")), _fmt(s.get("loss")), _fmt(s.get("clock")),
                        _fmt(s.get("lag")), str(m["lease_left_ms"]))
    console.print(members)
    parts = Table(title="partitions")
    for col in ("partition", "owner", "generation", "committed", "end", "lag"):
        parts.add_column(col)
    for p in status["partitions"]:
        parts.add_row(*(_fmt(p[k]) for k in ("partition", "owner", "generation", "committed",
                                             "end", "lag")))
    console.print(parts)
    tables = embedding_tables(status)
    if tables is not None:
        console.print(tables)


def run(args: argparse.Namespace) -> int:
    """Fetch and print the status; exit 1 if the coordinator cannot be reached."""
    console = Console()
    try:
        status = fetch_status(args.url, args.timeout_s)
    except (OSError, ValueError) as exc:
        console.print(f"[red]cannot read {args.url}/v1/status: {exc}[/red]")
        return 1
    if args.json:
        console.print_json(json.dumps(status))
    else:
        render(status, console)
    return 0
