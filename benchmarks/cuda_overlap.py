"""Part: on CUDA with NCCL, does a receive posted on the transport's own stream overlap compute queued before it?"""

from __future__ import annotations

import itertools
import statistics
import time
from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.distributed as dist

from benchmarks import harness, runner
from benchmarks.framework import Block, Part, Result
from benchmarks.internals import MailTransport, TensorSpec, Watchdog
from duplexpipe import Op

MODES = ("compute", "recv", "overlapped", "serialized")
"""compute: a GPU spin alone; recv: the receive alone; overlapped: the spin queued first, then the receive posted on
the transport's P2P stream (as the runtime does); serialized: the same with the receive on the compute stream."""


@dataclass(frozen=True)
class CudaOverlapConfig:
    """One message size, one spin length, repetitions; two ranks (sharing one GPU: NCCL over loopback sockets)."""

    mib: float = 256.0  # message size in MiB (float32)
    compute_ms: float = 0.0  # GPU spin per timed compute; 0: the measured receive time (overlap can halve the total)
    reps: int = 7  # timed repetitions per mode (after one untimed round)

    def __post_init__(self) -> None:
        if self.mib <= 0 or self.reps < 1 or self.compute_ms < 0:
            raise ValueError(f"need mib > 0, reps >= 1, compute_ms >= 0; got {self.mib}, {self.reps}, "
                             f"{self.compute_ms}")


def _cycles_per_ms() -> float:
    """GPU clock cycles per millisecond of `torch.cuda._sleep`, measured with CUDA events."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda._sleep(1_000_000)  # warm the kernel up
    start.record()
    torch.cuda._sleep(20_000_000)
    end.record()
    end.synchronize()
    return 20_000_000 / start.elapsed_time(end)


def _one(mode: str, rank: int, transport: MailTransport, buf: torch.Tensor, tag: int, spin: int) -> float:
    """One timed round of `mode` on this rank (rank 0 sends when rank 1 receives)."""
    torch.cuda.synchronize()
    dist.barrier()
    torch.cuda.synchronize()
    start = time.perf_counter()
    if rank == 0 and mode != "compute":
        transport.send((Op.SEND_F, 0, tag), [buf], 1)
        transport.wait_send((Op.SEND_F, 0, tag))
    elif rank != 0:
        if mode in ("compute", "overlapped", "serialized"):
            torch.cuda._sleep(spin)
        if mode != "compute":
            meta = (TensorSpec.of(buf),)
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
    """Per mode, rank 1's median from a synchronized device to a synchronized device (rank 0 only sends)."""
    device = torch.device("cuda", torch.cuda.current_device())
    store = dist.distributed_c10d._get_default_store()
    transport = MailTransport(None, device, Watchdog(store, "cuda-overlap", rank, 120.0, 0.005))
    buf = torch.arange(int(cfg.mib * 2**20 / 4), dtype=torch.float32, device=device)
    cycles, tags = _cycles_per_ms(), itertools.count(1)

    def rounds(mode: str, spin: int, n: int) -> list[float]:
        return [_one(mode, rank, transport, buf, next(tags), spin) for _ in range(n)]

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


def run(cfg: CudaOverlapConfig) -> Result:
    """The probe on 2 NCCL ranks."""
    result: dict[str, Any] = harness.spawn(worker, cfg, 2, 300.0, backend="nccl")[1]
    result.update(config=asdict(cfg), gpus=torch.cuda.device_count(), device=torch.cuda.get_device_name(0),
                  torch=torch.__version__, nccl=".".join(map(str, torch.cuda.nccl.version())))
    return result


def report(result: Result) -> list[Block]:
    """The medians and the share of the shorter part hidden by overlap."""
    med, cfg = result["median_ms"], result["config"]
    hidden = (med["compute"] + med["recv"] - med["overlapped"]) / min(med["compute"], med["recv"])
    return [f"{cfg['mib']:g} MiB message, {result['spin_ms']:.1f} ms GPU spin, median of {cfg['reps']}: hidden by the "
            f"P2P stream: {hidden:.0%} of the shorter part (serialized / overlapped = "
            f"{med['serialized'] / med['overlapped']:.2f})", [["mode", "median ms"]] +
            [[m, f"{med[m]:.2f}"] for m in MODES]]


PART = Part("cuda_overlap", "P2P stream overlap on CUDA", CudaOverlapConfig(), CudaOverlapConfig(mib=16.0, reps=2),
            run, report, in_bench=False)

if __name__ == "__main__":
    raise SystemExit(runner.main(only=PART.name))
