"""Tests for duplexpipe.launch.processes: local launcher, root-cause reporting, backend choice, torchrun."""

from __future__ import annotations

import json
import logging
import os
import queue
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from _failing_ranks import OWN_ERROR, blame_a_silent_rank, consequence_first, exited

from duplexpipe.errors import LaunchError, PeerFailedError
from duplexpipe.launch import processes
from duplexpipe.launch.failures import Failure
from duplexpipe.launch.processes import (
    FORKSERVER_PRELOAD,
    LOWEST_PORT,
    SHARE_GPU_ENV,
    START_METHOD_ENV,
    _failure,
    blamed_rank,
    cuda_device_for,
    default_backend,
    ephemeral_low,
    free_port,
    launch,
    launched_by_torchrun,
    local_environment,
    loopback_interface,
    run,
    start_context,
)
from duplexpipe.train.trainer import Pipeline, PipelineConfig

ROOT = Path(__file__).resolve().parents[2]
TORCHRUN = Path(sys.executable).parent / "torchrun"


def _sum_ranks(offset: int) -> tuple[int, int, int, torch.Tensor]:
    t = torch.tensor([dist.get_rank() + offset])
    dist.all_reduce(t)  # the tensor itself is returned too: results must outlive the worker process
    return dist.get_rank(), dist.get_world_size(), int(t.item()), t


def _crash_on_rank_one() -> None:
    if dist.get_rank() == 1:
        raise RuntimeError("boom from the test")
    dist.barrier()  # the others would wait forever; the launcher must kill them
    time.sleep(600)


def _hard_exit_on_rank_one() -> None:
    if dist.get_rank() == 1:
        os._exit(3)  # no traceback, no report: the launcher must notice the dead process
    dist.barrier()
    time.sleep(600)


def _killed_rank_zero() -> None:
    dist.barrier()
    if dist.get_rank() == 0:  # the store's host dies: the others fail on closed sockets, with C++ frames
        os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(0.5)
    dist.barrier()
    time.sleep(600)


def _children() -> list[int]:
    """Pids of live (non-zombie) descendants of this process: the ranks of a launch, which the fork server (the
    default start method) forks as its children.

    multiprocessing's own resource tracker and fork server (one per parent, exiting with it; other
    test modules start ranks from the fork server) are not counted.
    """
    parents: dict[int, list[tuple[int, str, bytes]]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
            cmdline = (stat.parent / "cmdline").read_bytes()
        except OSError:
            continue
        parents.setdefault(int(fields[1]), []).append((int(stat.parent.name), fields[0], cmdline))
    found, todo = [], [os.getpid()]
    while todo:
        parent = todo.pop()
        for pid, state, cmdline in parents.get(parent, []):
            todo.append(pid)
            helper = parent == os.getpid() and (b"resource_tracker" in cmdline or b"forkserver" in cmdline)
            if state != "Z" and not helper:  # the server's forks share its command line: only it is a helper
                found.append(pid)
    return found


def _pid_and_env() -> tuple[int, int, str | None]:
    return os.getpid(), os.getppid(), os.environ.get("DUPLEXPIPE_TEST_VALUE")



@pytest.mark.timeout(90)
def test_the_default_start_method_forks_from_a_server_with_the_launchers_environment(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """No start method given: the ranks come from the fork server (not this process's children), each with
    the environment of its launch (the server keeps the one it started with), and none outlives the call."""
    monkeypatch.delenv(START_METHOD_ENV, raising=False)
    monkeypatch.setenv("DUPLEXPIPE_TEST_VALUE", "first")
    first = run(_pid_and_env, 2)
    monkeypatch.setenv("DUPLEXPIPE_TEST_VALUE", "second")
    second = run(_pid_and_env, 2)
    assert [r[2] for r in first] == ["first", "first"] and [r[2] for r in second] == ["second", "second"]
    assert all(parent != os.getpid() for _, parent, _ in first + second)
    assert all(exited(pid) for pid, _, _ in first + second)


@pytest.mark.timeout(60)
def test_spawned_ranks_give_the_same_results_and_a_bad_method_is_named() -> None:
    assert [r[:3] for r in launch(_sum_ranks, 2, (10,), start_method="spawn")] == [(0, 2, 21), (1, 2, 21)]
    with pytest.raises(ValueError, match="start_method 'fork' is not one of"):
        launch(_sum_ranks, 2, (10,), start_method="fork")


def _listening() -> list[tuple[str, int]]:
    """(local address, port) of every TCP socket this process listens on (from /proc/net/tcp and tcp6)."""
    t = torch.ones(2)
    dist.all_reduce(t)  # gloo's pairs are connected: every socket it opens is open now
    inodes = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            link = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if link.startswith("socket:["):
            inodes.add(link[8:-1])
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            cols = line.split()
            if cols[3] == "0A" and cols[9] in inodes:  # LISTEN, owned by this process
                address, port = cols[1].rsplit(":", 1)
                found.append((address, int(port, 16)))
    return found


@pytest.mark.timeout(60)
@pytest.mark.skipif(not Path("/proc/net/tcp").exists(), reason="needs /proc/net/tcp")
def test_a_local_job_listens_on_loopback_only(monkeypatch: pytest.MonkeyPatch) -> None:
    """Rank 0's store and every rank's gloo sockets listen on 127.0.0.1 (torch's own store server would listen on
    every interface); an interface the launcher's environment names is kept."""
    monkeypatch.delenv("GLOO_SOCKET_IFNAME", raising=False)
    per_rank = launch(_listening, 2, start_method="forkserver")
    assert len(per_rank[0]) >= 2 and per_rank[1], per_rank  # rank 0: the store and gloo; rank 1: gloo
    assert {address for sockets in per_rank for address, _ in sockets} == {"0100007F"}, per_rank  # 127.0.0.1
    env = local_environment({"GLOO_SOCKET_IFNAME": "eth7"}, 1, 2, 29500)
    assert env["GLOO_SOCKET_IFNAME"] == "eth7" and env["MASTER_ADDR"] == "127.0.0.1" and env["RANK"] == "1"
    assert local_environment({}, 0, 2, 29500)["NCCL_SOCKET_IFNAME"] == loopback_interface()


@pytest.mark.timeout(60)
def test_run_returns_every_rank_result_and_logs_the_backend(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="duplexpipe.launch"):
        results = run(_sum_ranks, 2, (10,))
    assert [r[:3] for r in results] == [(0, 2, 21), (1, 2, 21)]
    assert [r[3].tolist() for r in results] == [[21], [21]]
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    want = "nccl" if gpus >= 2 else "gloo"
    assert f"2 processes on this machine on {want}" in caplog.text
    assert _children() == []


@pytest.mark.timeout(60)
def test_launch_reports_the_crashing_rank_and_leaves_no_process() -> None:
    with pytest.raises(LaunchError, match="rank 1 failed") as info:
        launch(_crash_on_rank_one, 2)
    assert info.value.rank == 1
    assert "RuntimeError: boom from the test" in info.value.details
    assert _children() == []


@pytest.mark.timeout(60)
def test_launch_names_a_rank_that_dies_without_a_report() -> None:
    with pytest.raises(LaunchError, match="rank 1 exited with code 3 without reporting a result") as info:
        launch(_hard_exit_on_rank_one, 2)
    assert info.value.rank == 1
    assert _children() == []


class _FailingStart:
    """A multiprocessing context whose rank-1 process cannot start (as when the system refuses a process)."""

    def __init__(self, real: Any) -> None:
        self.real = real

    def __getattr__(self, name: str) -> Any:
        return getattr(self.real, name)

    def Process(self, *args: Any, **kwargs: Any) -> Any:  # noqa: N802 (multiprocessing's name)
        process = self.real.Process(*args, **kwargs)
        if kwargs.get("name", "").endswith("rank1"):
            def refuse() -> None:
                raise OSError("the test refuses to start rank 1")
            process.start = refuse
        return process


@pytest.mark.timeout(60)
def test_a_rank_that_cannot_start_raises_its_own_error_and_leaves_no_process(monkeypatch: pytest.MonkeyPatch) -> None:
    real = processes.start_context
    monkeypatch.setattr(processes, "start_context", lambda method=None: _FailingStart(real(method)))
    with pytest.raises(OSError, match="the test refuses to start rank 1"):  # was: an AssertionError from join
        launch(_crash_on_rank_one, 2)
    assert _children() == []


class _Exiting:
    """A rank's process whose exit status the launcher sees only at its `reads`-th look (a rank's closed connection
    reaches its peer before the kernel reports its exit)."""

    def __init__(self, code: int | None, reads: int) -> None:
        self.code, self.reads = code, reads

    @property
    def exitcode(self) -> int | None:
        self.reads -= 1
        return self.code if self.reads <= 0 else None


RESET = Failure("Traceback ...\nRuntimeError: [pair.cc:537] Read error [127.0.0.1]:21737: Connection reset by peer.",
                None, "RuntimeError: [pair.cc:537] Read error [127.0.0.1]:21737: Connection reset by peer.")


def test_a_reset_connection_waits_for_the_silent_death_that_caused_it() -> None:
    error = _failure([_Exiting(None, 0), _Exiting(3, 20)], queue.Queue(), {}, {0: RESET}, grace_s=10.0)
    assert str(error).startswith("rank 1 exited with code 3 without reporting a result; then rank 0 stopped: "
                                 "RuntimeError: [pair.cc:537]"), str(error)
    assert error.rank == 1


def test_a_reset_connection_without_a_dead_peer_is_reported_after_the_grace() -> None:
    start = time.monotonic()
    error = _failure([_Exiting(None, 0), _Exiting(None, 0)], queue.Queue(), {}, {0: RESET}, grace_s=0.3)
    assert str(error).startswith("rank 0 failed:\nTraceback ...") and error.rank == 0
    assert time.monotonic() - start >= 0.3


@pytest.mark.timeout(90)
def test_a_killed_rank_is_the_first_line_and_the_others_one_line_each() -> None:
    """The cause sat under about 60 lines of the other ranks' TCPStore C++ frames."""
    with pytest.raises(LaunchError) as info:
        launch(_killed_rank_zero, 2)
    message = str(info.value)
    assert message.startswith("rank 0 was killed by signal 9 (SIGKILL: out of memory, or killed from outside) "
                              "without reporting a result"), message
    assert "\n" not in message and info.value.rank == 0
    if 1 in info.value.errors:  # rank 1 reported its consequence in time: one line here, all of it kept
        assert "then rank 1 stopped: " in message and "Traceback" in info.value.errors[1]
    assert _children() == []


def test_the_fork_server_preloads_the_hugging_face_stack_only_when_the_launcher_has_it(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from multiprocessing import forkserver

    monkeypatch.setitem(sys.modules, "transformers", sys.modules.get("transformers") or object())
    start_context("forkserver")
    assert "transformers.modeling_utils" in forkserver._forkserver._preload_modules
    monkeypatch.delitem(sys.modules, "transformers")
    start_context("forkserver")
    assert forkserver._forkserver._preload_modules == list(FORKSERVER_PRELOAD)


def test_launch_rejects_bad_counts() -> None:
    with pytest.raises(ValueError, match="nprocs must be >= 1, got 0"):
        launch(_sum_ranks, 0)


def _torchrun(extra: list[str], port: int) -> subprocess.Popen[str]:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    for var in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK"):
        env.pop(var, None)
    cmd = [str(TORCHRUN), *extra, "--master-addr", "127.0.0.1", "--master-port", str(port),
           str(ROOT / "examples" / "train_sequential.py"), "--steps", "3", "--json"]
    return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)  # its own process group: `started` kills agent and workers


def _rank0_json(outputs: list[str]) -> dict[str, object]:
    lines = [line for out in outputs for line in out.splitlines() if line.startswith("{")]
    assert len(lines) == 1, outputs
    return json.loads(lines[0])


@pytest.fixture
def started() -> Iterator[list[subprocess.Popen[str]]]:
    """The torchrun processes a test starts, killed (with their workers' process group) when it ends, so a test
    that fails or times out leaves no process behind for the next test's child check."""
    procs: list[subprocess.Popen[str]] = []
    yield procs
    for proc in procs:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)


@pytest.mark.timeout(400)  # three torchrun jobs: under load (2 busy cores, 2 test workers) each takes minutes
def test_torchrun_single_node_and_two_nodes(started: list[subprocess.Popen[str]]) -> None:
    assert not launched_by_torchrun()
    one = _torchrun(["--nproc-per-node", "2"], free_port())
    started.append(one)
    out, err = one.communicate(timeout=180)
    assert one.returncode == 0, err[-3000:]
    result = _rank0_json([out])
    assert result["world"] == 2 and len(result["losses"]) == 3

    port = free_port()
    nodes = [_torchrun(["--nnodes", "2", "--node-rank", str(r), "--nproc-per-node", "1"], port)
             for r in (0, 1)]
    started.extend(nodes)
    outs = [p.communicate(timeout=180) for p in nodes]
    assert [p.returncode for p in nodes] == [0, 0], [e[-3000:] for _, e in outs]
    two = _rank0_json([o for o, _ in outs])
    assert two["world"] == 2
    assert two["losses"] == result["losses"]


def test_blamed_rank_tells_consequences_from_own_errors() -> None:
    assert blamed_rank(PeerFailedError("rank 2: stopping because rank 3 failed: boom", 3), 2) == 3
    assert blamed_rank(ValueError("rank 0 rejected its step inputs (see its error)"), 1) == 0
    assert blamed_rank(ValueError("rank 1 holds first stage(s) [1]: inputs are required"), 1) is None
    assert blamed_rank(RuntimeError("rank 1 failed to allocate"), 1) is None  # names itself
    assert blamed_rank(RuntimeError("shape mismatch"), 0) is None
    try:
        try:
            raise PeerFailedError("rank 1: stopping because rank 0 failed: x", 0)
        except PeerFailedError as inner:
            raise RuntimeError("step failed") from inner
    except RuntimeError as outer:
        assert blamed_rank(outer, 1) == 0


@pytest.mark.timeout(90)
def test_the_originating_error_comes_first_even_when_it_arrives_last() -> None:
    # rank 1's consequence reaches the launcher first, every time (rank 0 waits for rank 1's exit)
    with pytest.raises(LaunchError) as info:
        launch(consequence_first, 2, ("rejected", "exit"))
    err = info.value
    assert err.rank == 0 and str(err).startswith("rank 0 failed (then ranks [1] stopped):\nTraceback")
    assert str(err).rstrip().endswith(f"ValueError: {OWN_ERROR}") and OWN_ERROR in err.details
    assert sorted(err.errors) == [0, 1]
    assert "rank 0 rejected its step inputs" in err.errors[1]
    assert _children() == []


def _reject_on_rank_zero() -> None:
    x = torch.randn(8, 4)
    pipe = Pipeline([torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)], torch.nn.functional.mse_loss,
                    lambda ps: torch.optim.SGD(ps, lr=0.1), PipelineConfig("1f1b", 2))
    pipe.step(None if dist.get_rank() == 0 else x, x)


@pytest.mark.timeout(90)
def test_a_rejected_batch_names_the_rank_that_rejected_it() -> None:
    with pytest.raises(LaunchError) as info:
        launch(_reject_on_rank_zero, 2)
    assert info.value.rank == 0
    assert str(info.value).rstrip().endswith("ValueError: rank 0 holds first stage(s) [0]: inputs are required")


@pytest.mark.timeout(60)
def test_a_blamed_rank_that_never_reports_is_waited_for_then_named() -> None:
    with pytest.raises(LaunchError, match="rank 1 failed, blaming rank 0, which reported no error within 1s"):
        launch(blame_a_silent_rank, 2, grace_s=1.0)
    assert _children() == []


def test_backend_is_nccl_only_with_a_gpu_per_process(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert default_backend(2) == "nccl" and default_backend(1) == "nccl"
    assert default_backend(4) == "gloo"
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "3")
    assert default_backend() == "gloo"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert default_backend(1) == "gloo"


def test_ranks_share_a_gpu_only_when_asked(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    for var in (SHARE_GPU_ENV, "NCCL_HOSTID", "NCCL_SOCKET_IFNAME", "NCCL_IB_DISABLE"):
        monkeypatch.delenv(var, raising=False)
    assert cuda_device_for(0) == 0 and default_backend(2) == "gloo"
    with pytest.raises(ValueError, match=f"NCCL rank 1 needs GPU 1, but this machine has 1; use gloo, or set "
                                         f"{SHARE_GPU_ENV}=1 to share GPUs"):
        cuda_device_for(1)
    monkeypatch.setenv(SHARE_GPU_ENV, "1")
    assert default_backend(2) == "nccl"
    assert cuda_device_for(3) == 0
    assert os.environ["NCCL_HOSTID"] == "duplexpipe-shared-gpu-rank-3"  # its own "host": no duplicate-GPU check
    assert os.environ["NCCL_SOCKET_IFNAME"] == "lo"
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    with pytest.raises(ValueError, match="needs GPU 1, but this machine has 0"):
        cuda_device_for(1)


@pytest.mark.timeout(120)
def test_torchrun_names_the_originating_rank_as_root_cause(tmp_path: Path) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    for var in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK"):
        env.pop(var, None)
    cmd = [str(TORCHRUN), "--nproc-per-node", "2", "--master-addr", "127.0.0.1", "--master-port",
           str(free_port()), str(ROOT / "tests" / "_failing_ranks.py"), str(tmp_path / "flag")]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=100)
    assert proc.returncode != 0
    root = proc.stderr.split("Root Cause (first observed failure):", 1)
    assert len(root) == 2, proc.stderr[-3000:]
    assert "rank      : 0 (local_rank: 0)" in root[1] and OWN_ERROR in root[1], root[1]
    # the consequence names its cause, in its own failure entry and its log line
    assert "rank 1 stopped because rank 0 failed" in root[0], proc.stderr[-3000:]


def test_free_port_is_drawn_below_the_ephemeral_range_and_binds(tmp_path: Path) -> None:
    low = ephemeral_low()
    ports = {free_port() for _ in range(5)}
    if low > LOWEST_PORT:
        assert all(LOWEST_PORT <= p < low for p in ports), (ports, low)
    else:  # no room below the ephemeral range: the kernel's choice
        assert all(p >= low for p in ports), (ports, low)
    for port in ports:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.bind(("127.0.0.1", port))
    (tmp_path / "range").write_text("40000\t60999\n")
    assert ephemeral_low(str(tmp_path / "range")) == 40000
    assert ephemeral_low(str(tmp_path / "missing")) == 32768


def test_torchruns_port_taken_is_one_line_naming_it(monkeypatch: pytest.MonkeyPatch,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    """Rank 0 serves env://'s rendezvous on MASTER_PORT: another process listening there was a DistNetworkError
    traceback ("The server socket has failed to listen ... EADDRINUSE")."""
    from duplexpipe.cli import main

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        for name, value in (("RANK", "0"), ("WORLD_SIZE", "1"), ("LOCAL_RANK", "0"), ("MASTER_ADDR", "127.0.0.1"),
                            ("MASTER_PORT", str(port))):
            monkeypatch.setenv(name, value)
        monkeypatch.delenv("TORCHELASTIC_USE_AGENT_STORE", raising=False)
        code = main(["train", "--ranks", "1", "--schedule", "gpipe", "--steps", "1", "--timeout", "10"])
    err = capsys.readouterr().err
    assert code == 2 and err == (f"duplexpipe: error: MASTER_PORT {port} on 127.0.0.1 is taken by another process: "
                                 "rank 0 cannot serve the rendezvous there; choose a free port (torchrun "
                                 "--master-port)\n"), err
