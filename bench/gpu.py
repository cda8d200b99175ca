"""The trainer's step on a device: its phases, and the ratio to a plain PyTorch loop on the same device.

One short script for the day a CUDA device is lent (on a machine without one it runs on the CPU
and says so). In one run, on one device, against one ``redis-server`` on loopback:

1. **Plain loop** (the ceiling): the model and ``torch.optim.Adam`` on the device, forward,
   backward and step on device-resident batches (``--batch`` records of synthetic data).
2. **The trainer's step** as the pipeline runs it, phase by phase: *pull* (the changed shards
   into the replica's parameters on the device), *compute* (``Replica.step``: forward and backward,
   bf16 autocast on CUDA), *encode* (``Pusher.prepare``: error feedback, top-k and the fp16 cast on
   the device; only the kept values and their indices cross to the host), *push* (to Redis). The
   server's apply (lazy Adam, on the CPU) runs between steps, as one trainer under BSP sees it,
   and is timed apart: in the pipeline it runs in its own process.

Prints the phases (ms per step), the bytes that crossed from the device per step against the
gradient's fp32 bytes, writes ``bench/results/gpu.json``, and prints last the ratio of the trainer's
step rate (pull + compute + encode + push) to the plain loop's.

    .venv/bin/python bench/gpu.py [--model mlp-2m] [--steps 200] [--device auto]
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import time
from collections.abc import Iterator
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a file: the repository first (bench.harness)

import torch

from bench import harness
from common.keys import JobKeys
from services import OptimizerConfig, ParameterServer, ParameterStore, Pusher, ServerSettings, connect
from services.codecs.sparse import TopKCodec
from streamtrain.launcher import RedisServer
from trainers import build_model, plan_device
from trainers.step import Replica

JOB = "bench-gpu"


def batches(width: int, classes: int, batch: int, count: int, device: torch.device) -> list[tuple[torch.Tensor, ...]]:
    """``count`` synthetic batches, made once (data loading is not what is measured)."""
    gen = torch.Generator().manual_seed(0)
    return [(torch.randn(batch, width, generator=gen).to(device), torch.randint(0, classes, (batch,), generator=gen)
             .to(device)) for _ in range(count)]


class Phases:
    """Milliseconds of each phase per step, the device's queued work included."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.ms: dict[str, list[float]] = {}

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    @contextlib.contextmanager
    def time(self, phase: str) -> Iterator[None]:
        """Time the block as ``phase``."""
        self._sync()
        t = time.perf_counter()
        yield
        self._sync()
        self.ms.setdefault(phase, []).append((time.perf_counter() - t) * 1e3)

    def medians(self, warmup: int = 10) -> dict[str, float]:
        """Median ms of each phase after ``warmup`` steps."""
        return {phase: statistics.median(ms[warmup:]) for phase, ms in self.ms.items()}


def plain_loop(model_name: str, data: list[tuple[torch.Tensor, ...]], device: torch.device) -> float:
    """Median ms per step of the plain loop on ``device`` (after 10 warm-up steps)."""
    spec = build_model(model_name, seed=1)
    model = spec.model.to(device)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)

    def step(x: torch.Tensor, y: torch.Tensor) -> None:
        opt.zero_grad(set_to_none=True)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
            out = model(x)
        spec.loss_fn(out.float(), y).backward()
        opt.step()

    phases = Phases(device)
    for x, y in data:
        with phases.time("step"):
            step(x, y)
    return phases.medians()["step"]


def trainer_steps(model_name: str, data: list[tuple[torch.Tensor, ...]], url: str, device: str,
                  codec: str, density: float) -> dict[str, float]:
    """Median ms per step of each phase of the trainer's step, and the bytes crossing from the device."""
    plan = plan_device(device)
    replica = Replica(build_model(model_name, seed=1), plan)
    client = connect(url)
    store = ParameterStore(client, JOB)
    store.init_model(replica.initial_tensors(), optimizer=OptimizerConfig(name="lazyadam", lr=1e-3))
    keys = JobKeys(JOB)
    client.set(keys.generation, 1)
    client.hset(keys.members, "bench", "{}")
    client.hset(keys.assignment, "0", "bench|1")
    pusher = Pusher(client, JOB, "bench", codec=codec, codec_options={"density": density})
    server = ParameterServer(ServerSettings(redis_url=url, job=JOB, block_ms=1, batch=1), client=client)
    server.load()
    snap = store.pull(out=replica.tensors)
    phases = Phases(plan.device)
    sparsifier = pusher.codec.parts[0]
    # what leaves the device per step: each shard's kept values (fp32) and indices (int64), or all of it
    crossed = sum(12 * sparsifier.k(s.numel) if isinstance(sparsifier, TopKCodec) else 4 * s.numel
                  for s in pusher.layout.shards)
    for clock, (x, y) in enumerate(data, start=1):
        with phases.time("pull"):
            snap = store.pull(snap, out=replica.tensors)
        with phases.time("compute"):
            result = replica.step(x, y)
        with phases.time("encode"):
            prepared = pusher.prepare(result.grads, generation=1, clock=clock, offsets={0: (clock - 1, clock)})
        with phases.time("push"):
            pusher.send(prepared)
        pusher.adopt(prepared.feedback)
        with phases.time("apply"):
            server.step()
    client.close()
    out = phases.medians()
    out["crossed_bytes"] = float(crossed)
    out["grad_bytes"] = 4.0 * pusher.layout.numel
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="mlp-2m", help="a built-in model (mlp-2m: 784-wide synthetic input)")
    parser.add_argument("--batch", type=int, default=256, help="records per step")
    parser.add_argument("--steps", type=int, default=200, help="steps of each loop (the first 10 are warm-up)")
    parser.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N")
    parser.add_argument("--codec", default="topk+fp16", help="the job's codec")
    parser.add_argument("--density", type=float, default=0.01, help="top-k density")
    args = parser.parse_args()
    harness.start()
    plan = plan_device(args.device)
    if plan.kind != "cuda":
        print(f"no CUDA device: measuring on {plan.device} (the figures are the CPU path's)")
    first = next(iter(build_model(args.model).model.parameters()))
    layers = [m for m in build_model(args.model).model.modules() if isinstance(m, torch.nn.Linear)]
    data = batches(first.shape[1], layers[-1].out_features, args.batch, args.steps, plan.device)
    plain = plain_loop(args.model, data, plan.device)
    with RedisServer() as server:
        ours = trainer_steps(args.model, data, server.url, args.device, args.codec, args.density)
    step_ms = ours["pull"] + ours["compute"] + ours["encode"] + ours["push"]
    device_name = torch.cuda.get_device_name(plan.device) if plan.kind == "cuda" else "cpu"
    print(f"device {plan.device} ({device_name}), "
          f"model {args.model}, batch {args.batch}, codec {args.codec} at {args.density:g}")
    print(f"plain loop: {plain:.3f} ms per step")
    print("trainer step, ms: " + ", ".join(f"{p} {ours[p]:.3f}" for p in ("pull", "compute", "encode", "push"))
          + f" (server apply {ours['apply']:.3f}, apart)")
    print(f"bytes from the device per step: {ours['crossed_bytes']:,.0f} of the gradient's "
          f"{ours['grad_bytes']:,.0f} fp32 bytes ({ours['crossed_bytes'] / ours['grad_bytes']:.2%})")
    harness.finish("gpu", {"device": str(plan.device), "device_name": device_name, "kind": plan.kind,
                           "model": args.model, "batch": args.batch, "steps": args.steps, "codec": args.codec,
                           "density": args.density, "plain_loop_ms": plain, "trainer_step_ms": step_ms,
                           "phases_ms": ours, "ratio": plain / step_ms},
                   [f"ratio trainer step / plain loop, {args.model} on {plan.kind}: {plain / step_ms:.2f}"])


if __name__ == "__main__":
    main()
