"""ZeRO collectives on flat shards: reduce-scatter (exact, bf16/fp16, int8 = ZeRO++ qgZ) and all-gather (exact,
int8 = ZeRO++ qwZ), each posted asynchronously and finished with the caller's bounded wait.

Layout: a flat tensor of `n * shard` elements over a group of n ranks; rank r owns elements
[r * shard, (r + 1) * shard). reduce_scatter leaves the mean over the group of rank r's chunk in its `out`;
all_gather fills every chunk of `out` from each owner's `shard`.

Quantized paths never sum codes that ranks quantized with different scales: qgZ sends each chunk's int8
codes and fp32 block scales to its owner (all_to_all), the owner dequantizes every rank's chunk and sums in
fp32 (float64 for float64 data). qwZ quantizes the owner's shard, all-gathers codes and scales, and every rank
(the owner too) dequantizes the same bytes, so the replicas stay bit-identical.
"""

from __future__ import annotations

from collections.abc import Generator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from duplexpipe.comm.meter import WireMeter
from duplexpipe.comm.quantize import dequantize_int8, quantize_int8, work_dtype
from duplexpipe.comm.reducers import _pack, _unpack
from duplexpipe.comm.reduction import Waitable, WaitFn, blocking_wait
from duplexpipe.dp_options.compression import (
    Bf16Options,
    Fp16Options,
    Int8Options,
    NoCompression,
    Options,
    check_sharded,
)

Steps = Generator[tuple[Waitable, str], None, None]
"""A collective's body: yields (work, what) for each collective it must wait for before going on."""


class Pending:
    """One collective in flight (its first step already posted); finish() completes it."""

    def __init__(self, steps: Steps) -> None:
        self._steps = steps
        self._current: tuple[Waitable, str] | None = next(steps, None)

    @property
    def done(self) -> bool:
        """True once the result is in place."""
        return self._current is None

    @property
    def work(self) -> Waitable | None:
        """The collective it waits for next (None when done)."""
        return None if self._current is None else self._current[0]

    def finish(self, wait: WaitFn = blocking_wait) -> None:
        """Wait (with `wait`) for each remaining collective and run what follows it."""
        while self._current is not None:
            work, what = self._current
            wait(work, what)
            work.wait()  # surfaces the work's error (returns at once: it completed)
            self._current = next(self._steps, None)


def _reduce_scatter(out: Tensor, flat: Tensor, group: Any) -> Any:
    """Post a sum reduce-scatter (torch >= 2.10 names it reduce_scatter_single)."""
    post = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    return post(out, flat, group=group, async_op=True)


def _all_gather(out: Tensor, chunk: Tensor, group: Any) -> Any:
    """Post an all-gather into one tensor (torch >= 2.10 names it all_gather_single)."""
    post = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    return post(out, chunk, group=group, async_op=True)


@dataclass(frozen=True)
class _Int8Layout:
    """How a chunk of `chunk` elements is quantized: padded to whole blocks."""

    chunk: int
    block: int

    @property
    def padded(self) -> int:
        return self.block * -(-self.chunk // self.block)

    @property
    def scales(self) -> int:
        return self.padded // self.block


Segments = Sequence[Sequence[int]]
"""Per rank of the group, the lengths of the runs its chunk is made of (e.g. the parameters' pieces in it)."""


class _SegmentBlocks:
    """int8 blocks that never cross a segment boundary: each segment of a rank's chunk is cut into blocks of
    `block` elements, its last block shorter, so a tensor never shares a scale with its neighbour (a LayerNorm
    weight near 1 beside weights near 0.02 would otherwise quantize those to a few levels). Codes go on the
    wire unpadded; each rank's scales are padded to the largest count in the group."""

    def __init__(self, segments: Segments, chunk: int, block: int, size: int) -> None:
        if len(segments) != size or any(sum(s) != chunk or min(s, default=0) < 0 for s in segments):
            raise ValueError(f"segments must give, for each of the {size} ranks, non-negative lengths summing to "
                             f"the chunk of {chunk} elements, got {[list(s) for s in segments]}")
        self.block = block
        self.keeps: list[Tensor] = []
        """Per rank: where its chunk's elements sit in the block-padded layout."""
        self.padded: list[int] = []
        for lengths in segments:
            starts, pos = [], 0
            for length in lengths:
                starts.append(torch.arange(pos, pos + length))
                pos += block * -(-length // block)
            self.keeps.append(torch.cat(starts) if starts else torch.zeros(0, dtype=torch.long))
            self.padded.append(pos)
        self.scales = max(p // block for p in self.padded)
        """Scales each rank sends (its own count, zero-padded to the group's largest)."""

    def quantize(self, x: Tensor, rank: int, generator: torch.Generator | None) -> tuple[Tensor, Tensor]:
        """(codes of x, unpadded; its block scales padded to `scales`) under `rank`'s segments."""
        keep = self.keeps[rank].to(x.device)
        padded = x.new_zeros(self.padded[rank])
        padded[keep] = x
        codes, scales = quantize_int8(padded, self.block, generator)
        return codes[keep], torch.cat([scales, scales.new_zeros(self.scales - scales.numel())])

    def dequantize(self, codes: Tensor, scales: Tensor, rank: int, dtype: torch.dtype) -> Tensor:
        """quantize()'s inverse for a chunk laid out by `rank`'s segments."""
        keep = self.keeps[rank].to(codes.device)
        padded = codes.new_zeros(self.padded[rank])
        padded[keep] = codes
        used = self.padded[rank] // self.block
        return dequantize_int8(padded, scales[:used].contiguous(), self.block, dtype)[keep]


class ShardComm:
    """Reduce-scatter and all-gather of flat shards over `group`, metered on `meter` (ring-model bytes).

    `gradients` chooses the reduce-scatter's wire format, `weights` (None or Int8Options) the all-gather's.
    Stochastic rounding draws from a generator seeded by (options.seed, this rank, the caller's `draw` key),
    so a step's draws depend only on that key: resume needs no generator state.
    """

    def __init__(self, group: Any = None, meter: WireMeter | None = None, *, gradients: Options | None = None,
                 weights: Int8Options | None = None) -> None:
        self.group = group
        self.size = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self.meter = meter if meter is not None else WireMeter()
        self.gradients = check_sharded(gradients if gradients is not None else NoCompression())
        if weights is not None and not isinstance(weights, Int8Options):
            raise ValueError(f"quantized weight all-gather takes Int8Options or None, got {weights!r}")
        self.weights = weights

    def shard_size(self, numel: int) -> int:
        """Elements each rank owns of a flat buffer of `numel`: ceil(numel / n)."""
        return -(-numel // self.size)

    def reduce_scatter(self, flat: Tensor, out: Tensor, what: str = "gradients", draw: int = 0,
                       segments: Segments | None = None) -> Pending:
        """Start leaving the mean over the group of this rank's chunk of `flat` in `out` (int8: blocks inside
        each rank's `segments` when given, else fixed blocks across the chunk)."""
        self._check(flat, out, "reduce_scatter")
        method = self.gradients
        if isinstance(method, Int8Options):
            if segments is not None:
                blocks = _SegmentBlocks(segments, out.numel(), method.block, self.size)
                return Pending(self._segmented_reduce_scatter(flat, out, what, method, draw, blocks))
            return Pending(self._int8_reduce_scatter(flat, out, what, method, draw))
        if isinstance(method, (Bf16Options, Fp16Options)):
            return Pending(self._cast_reduce_scatter(flat, out, what, method))
        return Pending(self._exact_reduce_scatter(flat, out, what))

    def all_gather(self, out: Tensor, shard: Tensor, what: str = "parameters", draw: int = 0,
                   exact: bool = False, segments: Segments | None = None) -> Pending:
        """Start filling every rank's chunk of `out` with that rank's `shard` (int8 blocks when `weights` is
        set, unless `exact`, inside each rank's `segments` when given; `shard` may be this rank's own chunk of
        `out`)."""
        self._check(out, shard, "all_gather")
        if self.weights is not None and not exact:
            if segments is not None:
                blocks = _SegmentBlocks(segments, shard.numel(), self.weights.block, self.size)
                return Pending(self._segmented_all_gather(out, shard, what, self.weights, draw, blocks))
            return Pending(self._int8_all_gather(out, shard, what, self.weights, draw))
        return Pending(self._exact_all_gather(out, shard, what))

    def _check(self, flat: Tensor, chunk: Tensor, kind: str) -> None:
        if flat.dim() != 1 or chunk.dim() != 1 or not flat.is_contiguous() or not chunk.is_contiguous():
            raise ValueError(f"{kind} needs flat contiguous tensors, got shapes {tuple(flat.shape)} and "
                             f"{tuple(chunk.shape)}")
        if flat.numel() != self.size * chunk.numel() or flat.dtype != chunk.dtype:
            raise ValueError(f"{kind}: the flat tensor has {flat.numel()} elements ({flat.dtype}), expected "
                             f"{self.size} x {chunk.numel()} ({chunk.dtype})")

    def _generator(self, options: Int8Options, draw: int, device: torch.device) -> torch.Generator | None:
        if not options.stochastic:
            return None
        gen = torch.Generator(device=device)
        gen.manual_seed(((options.seed * 1_000_003 + self.rank) * 1_000_003 + draw) % (2**63))
        return gen

    def _exact_reduce_scatter(self, flat: Tensor, out: Tensor, what: str) -> Steps:
        self.meter.record("reduce_scatter", flat.numel() * flat.element_size(), self.size)
        yield _reduce_scatter(out, flat, self.group), f"the reduce-scatter of {what}"
        out.div_(self.size)

    def _cast_reduce_scatter(self, flat: Tensor, out: Tensor, what: str, method: Bf16Options | Fp16Options) -> Steps:
        dtype = torch.bfloat16 if isinstance(method, Bf16Options) else torch.float16
        low = flat.to(dtype).div_(self.size)  # divide first, as torch's compression hooks do (fp16 range)
        low_out = torch.empty(out.numel(), dtype=dtype, device=out.device)
        self.meter.record("reduce_scatter", low.numel() * low.element_size(), self.size)
        yield _reduce_scatter(low_out, low, self.group), f"the {method.method} reduce-scatter of {what}"
        out.copy_(low_out)

    def _int8_reduce_scatter(self, flat: Tensor, out: Tensor, what: str, opts: Int8Options, draw: int) -> Steps:
        n, lay = self.size, _Int8Layout(out.numel(), opts.block)
        dtype = work_dtype(flat.dtype)
        rows = flat.view(n, lay.chunk)
        if lay.padded != lay.chunk:
            rows = torch.cat([rows, rows.new_zeros(n, lay.padded - lay.chunk)], dim=1)
        codes, scales = quantize_int8(rows, opts.block, self._generator(opts, draw, flat.device))
        send = _pack(codes.view(n, lay.padded), scales.view(n, lay.scales))
        recv = torch.empty_like(send)
        self.meter.record("all_to_all", send.numel(), n)
        work = dist.all_to_all_single(recv, send, group=self.group, async_op=True)
        yield work, f"the int8 all_to_all (qgZ) of {what}"
        got_codes, got_scales = _unpack(recv, (torch.int8, lay.padded), (torch.float32, lay.scales))
        ranks = dequantize_int8(got_codes.reshape(-1), got_scales.reshape(-1), opts.block, dtype)
        out.copy_(ranks.view(n, lay.padded)[:, : lay.chunk].sum(dim=0).div_(n))

    def _exact_all_gather(self, out: Tensor, shard: Tensor, what: str) -> Steps:
        self.meter.record("all_gather", out.numel() * out.element_size(), self.size)
        yield _all_gather(out, shard, self.group), f"the all-gather of {what}"

    def _int8_all_gather(self, out: Tensor, shard: Tensor, what: str, opts: Int8Options, draw: int) -> Steps:
        n, lay = self.size, _Int8Layout(shard.numel(), opts.block)
        codes, scales = quantize_int8(shard, opts.block, self._generator(opts, draw, shard.device))
        if lay.padded != lay.chunk:
            codes = torch.cat([codes, codes.new_zeros(lay.padded - lay.chunk)])
        mine = _pack(codes.view(1, lay.padded), scales.view(1, lay.scales)).view(-1)
        gathered = mine.new_empty(n * mine.numel())
        self.meter.record("all_gather", gathered.numel(), n)
        yield _all_gather(gathered, mine, self.group), f"the int8 all-gather (qwZ) of {what}"
        all_codes, all_scales = _unpack(gathered.view(n, -1), (torch.int8, lay.padded), (torch.float32, lay.scales))
        values = dequantize_int8(all_codes.reshape(-1), all_scales.reshape(-1), opts.block, work_dtype(out.dtype))
        out.view(n, lay.chunk).copy_(values.view(n, lay.padded)[:, : lay.chunk])

    def _segmented_reduce_scatter(self, flat: Tensor, out: Tensor, what: str, opts: Int8Options, draw: int,
                                  blocks: _SegmentBlocks) -> Steps:
        n, chunk = self.size, out.numel()
        gen = self._generator(opts, draw, flat.device)
        coded = [blocks.quantize(row, r, gen) for r, row in enumerate(flat.view(n, chunk))]
        send = _pack(torch.stack([c for c, _ in coded]), torch.stack([s for _, s in coded]))
        recv = torch.empty_like(send)
        self.meter.record("all_to_all", send.numel(), n)
        work = dist.all_to_all_single(recv, send, group=self.group, async_op=True)
        yield work, f"the int8 all_to_all (qgZ) of {what}"
        codes, scales = _unpack(recv, (torch.int8, chunk), (torch.float32, blocks.scales))
        dtype = work_dtype(flat.dtype)
        ranks = torch.stack([blocks.dequantize(codes[j], scales[j], self.rank, dtype) for j in range(n)])
        out.copy_(ranks.sum(dim=0).div_(n))

    def _segmented_all_gather(self, out: Tensor, shard: Tensor, what: str, opts: Int8Options, draw: int,
                              blocks: _SegmentBlocks) -> Steps:
        n, chunk = self.size, shard.numel()
        codes, scales = blocks.quantize(shard, self.rank, self._generator(opts, draw, shard.device))
        mine = _pack(codes.view(1, chunk), scales.view(1, blocks.scales)).view(-1)
        gathered = mine.new_empty(n * mine.numel())
        self.meter.record("all_gather", gathered.numel(), n)
        yield _all_gather(gathered, mine, self.group), f"the int8 all-gather (qwZ) of {what}"
        all_codes, all_scales = _unpack(gathered.view(n, -1), (torch.int8, chunk), (torch.float32, blocks.scales))
        rows = out.view(n, chunk)
        for j in range(n):
            rows[j].copy_(blocks.dequantize(all_codes[j], all_scales[j], j, work_dtype(out.dtype)))
