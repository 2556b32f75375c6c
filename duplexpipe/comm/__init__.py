"""What goes on the wire: transport codecs, quantizers, sparsifiers, error feedback, reducers, a byte meter.

The gradient compression options live in `duplexpipe.dp_options.compression` (their one home)."""

from duplexpipe.comm.bucket import Bucket
from duplexpipe.comm.build import build_reducer
from duplexpipe.comm.meter import C10dCounter, WireMeter, ring_bytes
from duplexpipe.comm.methods import check_optimizer
from duplexpipe.comm.nonfinite import NONFINITE_POLICIES, NonFiniteWatch
from duplexpipe.comm.p2p_codecs import P2P_COMPRESSION, Fp8RowCodec, Int8BlockCodec, p2p_codec_pair
from duplexpipe.comm.reduction import FutureWork, Reducer, Reduction, Waitable, WaitFn, blocking_wait

__all__ = [
    "NONFINITE_POLICIES", "P2P_COMPRESSION", "Bucket", "C10dCounter", "Fp8RowCodec", "FutureWork", "Int8BlockCodec",
    "NonFiniteWatch", "Reducer", "Reduction", "WaitFn", "Waitable", "WireMeter", "blocking_wait",
    "build_reducer", "check_optimizer", "p2p_codec_pair", "ring_bytes",
]
