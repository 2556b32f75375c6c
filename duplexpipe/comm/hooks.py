"""Reducers over torch's DDP communication hooks, run without DDP on a Bucket: bf16/fp16 casts and PowerSGD."""

from __future__ import annotations

from typing import Any, cast

import torch
from torch import Tensor
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import PowerSGDState, powerSGD_hook

from duplexpipe.comm.bucket import Bucket
from duplexpipe.comm.meter import WireMeter
from duplexpipe.comm.reduction import FutureWork, Phases, Reducer, Waitable
from duplexpipe.dp_options.compression import Bf16Options, Fp16Options, PowerSGDOptions


def _result_into(bucket: Bucket, buffer: Tensor, value: Any) -> None:
    """Leave the hook's result (a tensor, or a one-tensor list) in the bucket's original buffer."""
    result = value[0] if isinstance(value, (list, tuple)) else value
    if result is not buffer:
        buffer.copy_(result)
    bucket.set_buffer(buffer)


class CastReducer(Reducer):
    """torch's bf16_compress_hook or fp16_compress_hook: the buffer / n cast to 16 bits, one all_reduce,
    cast back. No error feedback (the rounding is not carried over)."""

    def __init__(self, options: Bf16Options | Fp16Options, group: Any = None, meter: WireMeter | None = None) -> None:
        super().__init__(group, meter)
        self.method = options.method
        self._hook = default_hooks.bf16_compress_hook if options.method == "bf16" else default_hooks.fp16_compress_hook

    def _phases(self, bucket: Bucket) -> Phases:
        buffer = bucket.buffer()
        self.meter.record("all_reduce", buffer.numel() * 2, self.size)
        future = self._hook(self.group, bucket)  # type: ignore[arg-type]
        yield FutureWork(future), f"the {self.method} all-reduce of gradient bucket {bucket.index()}"
        _result_into(bucket, buffer, future.value())


class PowerSGDReducer(Reducer):
    """torch's powerSGD_hook with one PowerSGDState (error feedback and warm start keyed by bucket index).

    The hook posts its second and third all-reduce from future callbacks, at moments that differ between
    ranks: so `group` must be this reducer's own (e.g. dist.new_group over the data-parallel ranks), and a
    bucket's hook runs only once the previous bucket's chain has completed (at start() if it has, else in
    finish()), so the chains never interleave and every rank posts the same sequence.

    Steps (not hook calls) are counted here: every bucket of a step sees the same `state.iter`, which
    end_step(True) advances; end_step(False) restores the error, P and Q of the step's buckets, the
    iteration and the random state, so a skipped step leaves no trace.
    """

    method = "powersgd"

    def __init__(self, options: PowerSGDOptions, group: Any = None, meter: WireMeter | None = None) -> None:
        super().__init__(group, meter)
        self.options = options
        self.state = PowerSGDState(
            process_group=group, matrix_approximation_rank=options.rank, start_powerSGD_iter=options.start_step,
            min_compression_rate=options.min_compression_rate, use_error_feedback=True,
            warm_start=options.warm_start, random_seed=options.seed)
        self._step_iter: int | None = None
        self._rng: Any = None
        self._saved: dict[int, tuple[Tensor | None, Tensor | None, Tensor | None]] = {}
        self._chain: torch.futures.Future[Any] | None = None

    def _phases(self, bucket: Bucket) -> Phases:
        st, index, buffer = self.state, bucket.index(), bucket.buffer()
        if self._step_iter is None:
            self._step_iter, self._rng = st.iter, st.rng.get_state()
        previous = self._chain
        if previous is not None and not previous.done():
            yield FutureWork(previous), f"the previous bucket's PowerSGD all-reduces (before bucket {index})"
        st.iter = self._step_iter
        p, q = st.p_memory_dict.get(index), st.q_memory_dict.get(index)
        self._saved[index] = (st.error_dict.get(index), None if p is None else p.clone(),
                              None if q is None else q.clone())
        numel_before = st.total_numel_after_compression
        exact = st.iter < st.start_powerSGD_iter
        future = powerSGD_hook(st, bucket)  # type: ignore[arg-type]
        self._chain = future
        self._meter(index, buffer, exact, st.total_numel_after_compression - numel_before)
        yield FutureWork(future), f"the PowerSGD all-reduces of gradient bucket {index}"
        _result_into(bucket, buffer, future.value())

    def _meter(self, index: int, buffer: Tensor, exact: bool, numel_sent: int) -> None:
        """The hook's all-reduces: the whole buffer while exact; else the uncompressed gradients, P and Q."""
        size = buffer.element_size()
        if exact:
            self.meter.record("all_reduce", buffer.numel() * size, self.size)
            return
        p, q = self.state.p_memory_dict[index].numel(), self.state.q_memory_dict[index].numel()
        for numel in (numel_sent - p - q, p, q):
            self.meter.record("all_reduce", numel * size, self.size)

    def take_residual(self, index: int) -> Tensor | None:
        """torch's error of the bucket (its flat layout: this rank's gradient minus the shared approximation)."""
        return self.state.error_dict.pop(index, None)

    def busy(self) -> Waitable | None:
        """The chain of all-reduces still in flight (None: none): nothing else may use the group meanwhile."""
        chain = self._chain
        return FutureWork(chain) if chain is not None and not chain.done() else None

    def _close(self, applied: bool) -> None:
        st = self.state
        if self._step_iter is not None:
            st.iter = self._step_iter + int(applied)
            if not applied:
                st.rng.set_state(self._rng)
                for index, (error, p, q) in self._saved.items():
                    for table, value in ((st.error_dict, error), (st.p_memory_dict, p), (st.q_memory_dict, q)):
                        if value is None:
                            table.pop(index, None)
                        else:
                            table[index] = value
        self._step_iter, self._rng, self._saved, self._chain = None, None, {}, None

    def state_dict(self) -> dict[str, Any]:
        """Iteration, error / P / Q by bucket index, and the random state of the initial Q."""
        st = self.state
        name, keys, pos, has_gauss, gauss = cast(Any, st.rng.get_state())
        return {**super().state_dict(), "iter": st.iter,
                "error": {i: t.clone() for i, t in st.error_dict.items()},
                "p": {i: t.clone() for i, t in st.p_memory_dict.items()},
                "q": {i: t.clone() for i, t in st.q_memory_dict.items()},
                "rng": (name, torch.from_numpy(keys.astype("int64")), int(pos), int(has_gauss), float(gauss))}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore state_dict()'s iteration, tables and random state."""
        super().load_state_dict(state)
        st = self.state
        st.iter = int(state["iter"])
        for table, key in ((st.error_dict, "error"), (st.p_memory_dict, "p"), (st.q_memory_dict, "q")):
            table.clear()
            table.update({int(i): t.clone() for i, t in state[key].items()})
        name, keys, pos, has_gauss, gauss = state["rng"]
        st.rng.set_state((name, keys.numpy().astype("uint32"), pos, has_gauss, gauss))
