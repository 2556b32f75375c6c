"""Compressing reducers: int8 blockwise (all_to_all, owner sums in fp32, all_gather) and sparse (all_gather)."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from duplexpipe.comm.bucket import Bucket
from duplexpipe.comm.dgc import DGCMemory, dgc_density
from duplexpipe.comm.feedback import ErrorFeedback
from duplexpipe.comm.meter import WireMeter
from duplexpipe.comm.quantize import dequantize_int8, quantize_int8, work_dtype
from duplexpipe.comm.reduction import Phases, Reducer
from duplexpipe.comm.sparsify import (
    Selection,
    keep_count,
    random_k,
    segment_keep_counts,
    threshold,
    top_k,
    top_k_segments,
)
from duplexpipe.dp_options.compression import DGCOptions, Int8Options, RandomKOptions, ThresholdOptions, TopKOptions


class _RankGenerator:
    """This rank's random generator (made on first use, on the buffers' device), snapshotted at the first
    draw of a step so a rolled-back step draws the same numbers again."""

    def __init__(self, seed: int, rank: int) -> None:
        self.seed = seed * 1_000_003 + rank
        self.generator: torch.Generator | None = None
        self._loaded: Tensor | None = None
        self._saved: Tensor | None = None

    def get(self, device: torch.device) -> torch.Generator:
        """The generator, remembering its state at the step's first use."""
        if self.generator is None:
            self.generator = torch.Generator(device=device)
            self.generator.manual_seed(self.seed)
            if self._loaded is not None:
                self.generator.set_state(self._loaded)
                self._loaded = None
        if self._saved is None:
            self._saved = self.generator.get_state()
        return self.generator

    def close(self, applied: bool) -> None:
        """Keep the step's draws (applied) or rewind to the step's start."""
        if not applied and self._saved is not None and self.generator is not None:
            self.generator.set_state(self._saved)
        self._saved = None

    def state(self) -> Tensor | None:
        """The generator's state (None before first use)."""
        if self.generator is None:
            return None if self._loaded is None else self._loaded.clone()
        return self.generator.get_state()

    def load(self, state: Tensor | None) -> None:
        """Restore a state() (None: start from the seed again); applied at the next use."""
        self.generator, self._saved = None, None
        self._loaded = None if state is None else state.clone()


def _pack(*parts: Tensor) -> Tensor:
    """Rows of several tensors (same row count) as one uint8 tensor (row-wise concatenation of bytes)."""
    rows = parts[0].shape[0]
    return torch.cat([p.contiguous().view(torch.uint8).reshape(rows, -1) for p in parts], dim=1)


def _unpack(raw: Tensor, *specs: tuple[torch.dtype, int]) -> list[Tensor]:
    """Undo _pack: for each (dtype, columns) the rows' slice viewed as that dtype."""
    out, offset = [], 0
    for dtype, cols in specs:
        width = cols * torch.empty((), dtype=dtype).element_size()
        out.append(raw[:, offset:offset + width].contiguous().view(dtype))
        offset += width
    return out


class Int8Reducer(Reducer):
    """Blockwise int8 with error feedback. Each rank quantizes g + r (stochastic rounding, one fp32 scale
    per block); all_to_all sends shard j's codes and scales to rank j; the owner dequantizes every rank's
    codes with that rank's scales, sums in fp32 (float64 for float64 buffers), divides by n, adds its own
    residual and requantizes; all_gather brings every shard back. Codes quantized with different scales are
    never summed. Per element, |result - exact mean| <= mean_i(scale_i) + scale_owner (fresh residuals)."""

    method = "int8"

    def __init__(self, options: Int8Options, group: Any = None, meter: WireMeter | None = None) -> None:
        super().__init__(group, meter)
        self.options = options
        self.residual = ErrorFeedback("int8 residual")
        self.owner_residual = ErrorFeedback("int8 owner residual")
        self.rng = _RankGenerator(options.seed, self.rank)

    def shard_size(self, numel: int) -> int:
        """Elements of the shard each rank owns: numel / n rounded up to whole blocks."""
        block = self.options.block
        return block * -(-numel // (self.size * block))

    def _phases(self, bucket: Bucket) -> Phases:
        buf, index, n, block = bucket.buffer(), bucket.index(), self.size, self.options.block
        dtype = work_dtype(buf.dtype)
        gen = self.rng.get(buf.device) if self.options.stochastic else None
        acc = self.residual.compensate(index, buf, dtype)
        shard = self.shard_size(acc.numel())
        padded = torch.cat([acc, acc.new_zeros(n * shard - acc.numel())])
        codes, scales = quantize_int8(padded, block, gen)
        self.residual.keep_difference(index, acc, dequantize_int8(codes, scales, block, dtype)[: acc.numel()])
        send = _pack(codes.view(n, shard), scales.view(n, shard // block))
        recv = torch.empty_like(send)
        yield self._all_to_all(recv, send), f"the int8 all_to_all of gradient bucket {index}"

        got_codes, got_scales = _unpack(recv, (torch.int8, shard), (torch.float32, shard // block))
        ranks = dequantize_int8(got_codes.reshape(-1), got_scales.reshape(-1), block, dtype).view(n, shard)
        mean = ranks.sum(dim=0).div_(n)
        owned = self.owner_residual.compensate(index, mean, dtype)
        codes, scales = quantize_int8(owned, block, gen)
        self.owner_residual.keep_difference(index, owned, dequantize_int8(codes, scales, block, dtype))
        mine = _pack(codes.view(1, shard), scales.view(1, -1)).view(-1)
        gathered = mine.new_empty(n * mine.numel())
        yield self._all_gather(gathered, mine), f"the int8 all_gather of gradient bucket {index}"

        all_codes, all_scales = _unpack(gathered.view(n, -1), (torch.int8, shard), (torch.float32, shard // block))
        out = dequantize_int8(all_codes.reshape(-1), all_scales.reshape(-1), block, dtype)
        buf.copy_(out[: buf.numel()])

    def take_residual(self, index: int) -> Tensor | None:
        """The local residual plus, at this rank's shard, n x its owner residual (held back from the mean, so n x
        it in one rank's gradient brings it back: exact for n a power of two)."""
        local, owned = self.residual.take(index), self.owner_residual.take(index)
        if local is None or owned is None:
            return local
        begin = self.rank * owned.numel()
        end = min(begin + owned.numel(), local.numel())
        if end > begin:
            local[begin:end].add_(owned[: end - begin], alpha=self.size)
        return local

    def _close(self, applied: bool) -> None:
        for state in (self.residual, self.owner_residual):
            state.commit() if applied else state.rollback()
        self.rng.close(applied)

    def state_dict(self) -> dict[str, Any]:
        """Local residuals, owner-shard residuals (by bucket index) and the rounding generator's state."""
        return {**super().state_dict(), "residual": self.residual.state_dict(),
                "owner_residual": self.owner_residual.state_dict(), "rng": self.rng.state()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore state_dict()'s residuals and generator."""
        super().load_state_dict(state)
        self.residual.load_state_dict(state["residual"])
        self.owner_residual.load_state_dict(state["owner_residual"])
        self.rng.load(state["rng"])


SparseOptionsT = TopKOptions | DGCOptions
"""Options the sparse reducer takes (RandomKOptions and ThresholdOptions are TopKOptions)."""


class SparseReducer(Reducer):
    """Top-k, random-k, threshold or DGC: k (value, int32 index) slots per rank and bucket (DGC with
    selection "tensor": k_i per tensor of the bucket, k = sum k_i; fixed per bucket and step), one all_gather,
    every rank adds all ranks' slots (in rank order) and divides by n. What a rank does not send stays in its
    error feedback (DGC: its velocity, with momentum correction and factor masking)."""

    def __init__(self, options: SparseOptionsT, group: Any = None, meter: WireMeter | None = None) -> None:
        super().__init__(group, meter)
        self.options = options
        self.method = options.method
        self.memory: ErrorFeedback | DGCMemory = (
            DGCMemory(options.momentum, options.clip_norm, self.size) if isinstance(options, DGCOptions)
            else ErrorFeedback(f"{options.method} residual"))
        self.rng = _RankGenerator(getattr(options, "seed", 0), self.rank)
        self.steps = 0
        """Committed steps (DGC's warm-up sparsity follows it)."""

    def density(self) -> float:
        """Fraction of each bucket transmitted in the current step."""
        opts = self.options
        if isinstance(opts, DGCOptions):
            return dgc_density(self.steps, opts.ratio, opts.warmup_steps)
        return opts.ratio

    def _select(self, acc: Tensor, bucket: Bucket) -> Selection:
        """Over the bucket, or (DGC with selection "tensor") k_i per tensor of the bucket."""
        opts, density = self.options, self.density()
        if isinstance(opts, DGCOptions) and opts.selection == "tensor":
            return top_k_segments(acc, bucket.numels, segment_keep_counts(bucket.numels, density))
        k = keep_count(acc.numel(), density)
        if isinstance(opts, RandomKOptions):
            return random_k(acc, k, self.rng.get(acc.device))
        if isinstance(opts, ThresholdOptions):
            return threshold(acc, k, opts.theta)
        return top_k(acc, k)

    def _phases(self, bucket: Bucket) -> Phases:
        buf, index, n = bucket.buffer(), bucket.index(), self.size
        if buf.numel() >= 2**31:
            raise ValueError(f"bucket {index} has {buf.numel()} elements; int32 indices need fewer than 2**31")
        dtype = work_dtype(buf.dtype)
        acc = self.memory.compensate(index, buf, dtype)
        chosen = self._select(acc, bucket)
        k = chosen.values.numel()
        mine = _pack(chosen.values.view(1, k), chosen.indices.to(torch.int32).view(1, k)).view(-1)
        self.memory.keep_rest(index, acc, chosen.chosen)
        gathered = mine.new_empty(n * mine.numel())
        yield self._all_gather(gathered, mine), f"the {self.method} all_gather of gradient bucket {index}"

        values, indices = _unpack(gathered.view(n, -1), (dtype, k), (torch.int32, k))
        out = torch.zeros(buf.numel(), dtype=dtype, device=buf.device)
        out.index_add_(0, indices.reshape(-1).long(), values.reshape(-1))
        buf.copy_(out.div_(n))

    def take_residual(self, index: int) -> Tensor | None:
        """The error feedback of top-k, random-k and threshold (None for DGC: its velocity carries momentum)."""
        return self.memory.take(index) if isinstance(self.memory, ErrorFeedback) else None

    def _close(self, applied: bool) -> None:
        self.memory.commit() if applied else self.memory.rollback()
        self.rng.close(applied)
        self.steps += int(applied)

    def state_dict(self) -> dict[str, Any]:
        """The error feedback (DGC: momentum and velocity) by bucket index, the step count, the generator."""
        return {**super().state_dict(), "memory": self.memory.state_dict(), "steps": self.steps,
                "rng": self.rng.state()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore state_dict()'s memory, step count and generator."""
        super().load_state_dict(state)
        self.memory.load_state_dict(state["memory"])
        self.steps = int(state["steps"])
        self.rng.load(state["rng"])
