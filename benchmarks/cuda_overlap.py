"""On CUDA with NCCL: does a receive posted on the transport's own stream overlap compute queued before it?

Two ranks. Rank 0 sends one message of `--mib` MiB through `Transport`; rank 1 times, from a synchronized
device to a synchronized device (median of `--reps`):
- `compute`: a GPU spin kernel of `compute_ms` on the compute stream alone;
- `recv`: the receive alone (expect, take);
- `overlapped`: the spin queued first, then the receive posted on the transport's P2P stream (as the
  runtime does: the CPU posts receives while earlier compute still runs on the GPU);
- `serialized`: the same with the receive posted on the compute stream, so it starts after the spin.
With overlap, `overlapped` is near max(compute, recv) and `serialized` near their sum. `compute_ms` is
the measured `recv` time unless given, so perfect overlap halves the serialized time.

With one GPU the two ranks share it ($DUPLEXPIPE_SHARE_GPU=1 is set for them): NCCL then moves the
message over its socket transport on the loopback interface, so `recv` is socket speed, not NVLink's.

Usage: python benchmarks/cuda_overlap.py [--mib N] [--compute-ms MS] [--reps N] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from benchmarks import harness  # noqa: E402
from duplexpipe.launch.processes import SHARE_GPU_ENV  # noqa: E402
from duplexpipe.runtime.stage_compute import TensorMeta  # noqa: E402
from duplexpipe.runtime.transport import Transport  # noqa: E402
from duplexpipe.runtime.watchdog import Watchdog  # noqa: E402
from duplexpipe.schedules.ir import Op  # noqa: E402

MODES = ("compute", "recv", "overlapped", "serialized")


@dataclass(frozen=True)
class CudaOverlapConfig:
    """One message size, one spin length, repetitions."""

    mib: float = 256.0
    """Message size in MiB (float32)."""
    compute_ms: float = 0.0
    """GPU spin per timed compute; 0 means the measured receive time."""
    reps: int = 7
    """Timed repetitions per mode (after one untimed round)."""


def _cycles_per_ms() -> float:
    """GPU clock cycles per millisecond of `torch.cuda._sleep`, measured with CUDA events."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda._sleep(1_000_000)  # warm the kernel up
    start.record()
    torch.cuda._sleep(20_000_000)
    end.record()
    end.synchronize()
    return 20_000_000 / start.elapsed_time(end)


def _one(mode: str, rank: int, transport: Transport, buf: torch.Tensor, tag: int, spin: int) -> float:
    """One timed round of `mode` on this rank (rank 0 sends when rank 1 receives)."""
    torch.cuda.synchronize()
    dist.barrier()
    torch.cuda.synchronize()
    start = time.perf_counter()
    if rank == 0:
        if mode != "compute":
            transport.send((Op.SEND_F, 0, tag), [buf], 1)
            transport.wait_send((Op.SEND_F, 0, tag))
    else:
        if mode in ("compute", "overlapped", "serialized"):
            torch.cuda._sleep(spin)
        if mode != "compute":
            meta = (TensorMeta.of(buf),)
            stream, transport.stream = transport.stream, (None if mode == "serialized" else transport.stream)
            try:
                transport.expect((Op.RECV_F, 1, tag), 0, lambda _block: meta)
                got = transport.take((Op.RECV_F, 1, tag), "the benchmark")[0]
            finally:
                transport.stream = stream
            if not torch.equal(got[:4], buf[:4]):
                raise RuntimeError("the received message differs from the one sent")
    torch.cuda.synchronize()
    return time.perf_counter() - start


def worker(rank: int, world: int, cfg: CudaOverlapConfig) -> dict[str, Any]:
    """Rank 1's medians per mode (rank 0 only sends)."""
    device = torch.device("cuda", torch.cuda.current_device())
    store = dist.distributed_c10d._get_default_store()
    transport = Transport(None, device, Watchdog(store, "cuda-overlap", rank, 120.0, 0.005))
    buf = torch.arange(int(cfg.mib * 2**20 / 4), dtype=torch.float32, device=device)
    cycles = _cycles_per_ms()
    tag = 0

    def rounds(mode: str, spin: int, n: int) -> list[float]:
        nonlocal tag
        out = []
        for _ in range(n):
            tag += 1
            out.append(_one(mode, rank, transport, buf, tag, spin))
        return out

    rounds("recv", 0, 2)
    recv_ms = statistics.median(rounds("recv", 0, 3)) * 1e3
    spin_ms = torch.tensor([cfg.compute_ms or recv_ms], dtype=torch.float64, device=device)
    dist.broadcast(spin_ms, 1)  # rank 1's receive time sets both ranks' spin
    spin = int(float(spin_ms.item()) * cycles)
    for mode in MODES:
        rounds(mode, spin, 1)
    samples: dict[str, list[float]] = {m: [] for m in MODES}
    for rep in range(cfg.reps):
        for mode in MODES if rep % 2 == 0 else MODES[::-1]:
            samples[mode] += rounds(mode, spin, 1)
    return {"spin_ms": float(spin_ms.item()), "cycles_per_ms": cycles,
            "median_ms": {m: statistics.median(v) * 1e3 for m, v in samples.items()},
            "samples_ms": {m: [x * 1e3 for x in v] for m, v in samples.items()}}


def summary(result: dict[str, Any], cfg: CudaOverlapConfig) -> str:
    """The medians and the share of the shorter part hidden by overlap."""
    med = result["median_ms"]
    hidden = (med["compute"] + med["recv"] - med["overlapped"]) / min(med["compute"], med["recv"])
    lines = [f"{cfg.mib:g} MiB message, {result['spin_ms']:.1f} ms GPU spin, median of {cfg.reps}:"]
    lines += [f"  {m:<11} {med[m]:8.2f} ms" for m in MODES]
    lines.append(f"  hidden by the P2P stream: {hidden:.0%} of the shorter part "
                 f"(serialized / overlapped = {med['serialized'] / med['overlapped']:.2f})")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Run the probe on 2 NCCL ranks; print and optionally save the result."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=float, default=CudaOverlapConfig.mib, help="message size in MiB")
    parser.add_argument("--compute-ms", type=float, default=0.0, help="GPU spin in ms (0: the receive time)")
    parser.add_argument("--reps", type=int, default=CudaOverlapConfig.reps, help="timed rounds per mode")
    parser.add_argument("--out", help="directory for cuda_overlap.json")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        parser.error("needs a CUDA GPU")
    if args.mib <= 0 or args.reps < 1 or args.compute_ms < 0:
        parser.error(f"need --mib > 0, --reps >= 1, --compute-ms >= 0; got {args.mib}, {args.reps}, "
                     f"{args.compute_ms}")
    if torch.cuda.device_count() < 2:
        os.environ[SHARE_GPU_ENV] = "1"
    cfg = CudaOverlapConfig(args.mib, args.compute_ms, args.reps)
    result = harness.spawn(worker, cfg, 2, 300.0, backend="nccl")[1]
    result.update(config=asdict(cfg), gpus=torch.cuda.device_count(), device=torch.cuda.get_device_name(0),
                  torch=torch.__version__, nccl=".".join(map(str, torch.cuda.nccl.version())))
    print(summary(result, cfg))
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "cuda_overlap.json").write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
