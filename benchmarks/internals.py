"""Every import the benchmarks take from below duplexpipe's public API, grouped by why: one file to edit."""
# ruff: noqa: I001, F401 - grouped by reason, not by module; each name is imported from here

from __future__ import annotations

# A measured step's timeline is per rank; the figures need all ranks' events on one clock.
from duplexpipe.runtime.timing import gather_timeline

# Whether a generator accepts (P, M) without building it (the public API only builds): the grids skip the rest.
from duplexpipe.schedules.registry import check as check_schedule

# The `auto` generator's search and its lower bound are what auto_search measures (schedule="auto" runs them unseen).
from duplexpipe.schedules.generators.auto import search, search_problem
from duplexpipe.schedules.generators.bounds import makespan_bound

# The stage-send codecs timed alone, outside a pipeline (p2p_compression).
from duplexpipe.comm.codec import TensorSpec
from duplexpipe.comm.p2p_codecs import p2p_codec_pair

# Gradient reducers driven directly on a bucket (compression), and the wire meters the ZeRO runs cross-check.
from duplexpipe.comm import Bucket, C10dCounter, WireMeter, build_reducer

# The option classes of gradient compression (their canonical home; the top level has only compression_options).
from duplexpipe.dp_options.compression import DGCOptions, Int8Options, Options, PowerSGDOptions, RandomKOptions
from duplexpipe.dp_options.compression import ThresholdOptions, TopKOptions

# Start methods and the GPU-sharing switch of the process launcher (spawn_bench, harness.spawn on NCCL).
from duplexpipe.launch.processes import SHARE_GPU_ENV, START_METHODS

# plan_vs_measured checks the planner's model term by term: its parts, link, machine and runtime-work models, and the
# profiler's cache eviction and saved-bytes counter, each run outside Pipeline's own planning.
from duplexpipe.model.split import build_parts
from duplexpipe.planner.calibrate import fit_cores
from duplexpipe.planner.dp_comm import Link
from duplexpipe.planner.machine import Machine, simulate_shared
from duplexpipe.sizes import format_bytes
from duplexpipe.planner.partition import balanced_split
from duplexpipe.planner.plan import PlanResult
from duplexpipe.planner.profile import PartProfile, RuntimeOverhead
from duplexpipe.planner.runtime_work import OverheadSample, rank_counts, rank_work, solve_overhead
from duplexpipe.runtime.saved_bytes import SavedBytes
from duplexpipe.train.part_chain import merge_parts
from duplexpipe.train.planning.measure import cache_evict_bytes

# cuda_overlap drives the transport alone (a receive on its P2P stream against queued compute): no schedule runs.
from duplexpipe.runtime.transport import MailTransport
from duplexpipe.runtime.watchdog import Watchdog

# moe_overlap reaches into the runtime because it times one F&B pair outside any schedule (the comm points, the pair
# runner, its own measuring driver) and emulates the link under a whole step (a benchmarking aid, in no config).
from duplexpipe.runtime.comm_points import CommRecord, CommSlot, Driver, Posted, current_driver, forward_slot
from duplexpipe.runtime.fb_pair import run_pair
from duplexpipe.comm.link import LinkModel
from duplexpipe.runtime.link_emulator import emulate_link

# reliability times the first step's batch fingerprint and a checkpoint manifest's hashing alone.
from duplexpipe.launch.job_guards import batch_fingerprint
from duplexpipe.train.checkpoint.manifest import digest

# vs_torch_tp builds torch's side of a tensor-parallel pipeline with the plan resolved per part as torch's
# parallelize_module takes it, counts each rank's local parameter bytes and the replicated ones (the TP facts); plan_tp
# plans a world's P x D x T meshes with those facts and measures the TP link as schedule="auto" does.
from duplexpipe.parallel.mesh import ParallelGroups
from duplexpipe.planner.world import plan_world
from duplexpipe.tp.facts import tp_facts
from duplexpipe.tp.plans import local_bytes, resolve
from duplexpipe.train.planning.calibration import measure_tp_link, tp_collective_work
