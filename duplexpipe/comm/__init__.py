"""What goes on the wire: transport codecs, quantizers, sparsifiers, error feedback, reducers, a byte meter."""

from duplexpipe.comm.bucket import Bucket
from duplexpipe.comm.build import build_reducer
from duplexpipe.comm.meter import C10dCounter, WireMeter, ring_bytes
from duplexpipe.comm.methods import (
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
from duplexpipe.comm.nonfinite import NONFINITE_POLICIES, NonFiniteWatch
from duplexpipe.comm.p2p_codecs import P2P_COMPRESSION, Fp8RowCodec, Int8BlockCodec, p2p_codec_pair
from duplexpipe.comm.reduction import FutureWork, Reducer, Reduction, Waitable, WaitFn, blocking_wait

__all__ = [
    "METHOD_NAMES", "NONFINITE_POLICIES", "P2P_COMPRESSION", "Bf16Options", "Bucket", "C10dCounter", "DGCOptions",
    "Fp16Options", "Fp8RowCodec", "FutureWork", "Int8BlockCodec", "Int8Options", "NoCompression",
    "NonFiniteWatch", "Options", "PowerSGDOptions", "RandomKOptions", "Reducer",
    "Reduction", "ThresholdOptions", "TopKOptions", "WaitFn", "Waitable", "WireMeter", "blocking_wait",
    "build_reducer", "check_optimizer", "compression_options", "p2p_codec_pair", "ring_bytes",
]
