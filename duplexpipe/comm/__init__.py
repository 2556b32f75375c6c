"""What goes on the wire: transport codecs, quantizers, sparsifiers, error feedback, reducers, a byte meter."""

from duplexpipe.comm.bucket import Bucket
from duplexpipe.comm.build import build_reducer
from duplexpipe.comm.meter import C10dCounter, WireMeter, ring_bytes
from duplexpipe.comm.options import (
    METHOD_NAMES,
    Bf16Options,
    DGCOptions,
    Fp16Options,
    Int8Options,
    NoCompression,
    Options,
    PowerSGDOptions,
    RandomKOptions,
    ThresholdOptions,
    TopKOptions,
    check_optimizer,
    compression_options,
)
from duplexpipe.comm.reduction import FutureWork, Reducer, Reduction, Waitable, WaitFn, blocking_wait

__all__ = [
    "METHOD_NAMES", "Bf16Options", "Bucket", "C10dCounter", "DGCOptions", "Fp16Options", "FutureWork",
    "Int8Options", "NoCompression", "Options", "PowerSGDOptions", "RandomKOptions", "Reducer", "Reduction",
    "ThresholdOptions", "TopKOptions", "WaitFn", "Waitable", "WireMeter", "blocking_wait", "build_reducer",
    "check_optimizer", "compression_options", "ring_bytes",
]
