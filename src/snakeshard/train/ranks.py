"""A training stage on several ranks (``ranks: N``, or ``resources.gpu: N``): the launcher, the ranks' collectives,
and the one line that names a rank that failed.

The job (``snakeshard train``) runs torchrun's own launcher in its process (``torch.distributed.run`` with
``--standalone --max-restarts 0 --monitor-interval 1``), which starts N rank processes (``snakeshard train ...
--rank-worker``): DDP replicas on backend nccl (rank r on ``cuda:r`` of the job's GPUs) or gloo (CPU). In process,
a failure comes back as torchrun's ``ChildFailedError`` with each failed rank's exit code, no text to parse.

* SIGTERM and SIGUSR1 (and SIGINT, SIGHUP, SIGQUIT) reach the launcher, which sends them on to the ranks; the
  ranks stop together at a step boundary after rank 0's checkpoint, and the job exits 75 as one rank does.
* A rank that dies or raises: the launcher sees it within a second, stops the others (SIGTERM, SIGKILL after its
  shutdown timeout: 30 s, or TORCH_ELASTIC_SHUTDOWN_TIMEOUT) and the job fails with one line naming the rank, its
  exit code or signal (and for a death, where a rerun resumes). A rank that hangs alive fails the others' next
  collective after ``COLLECTIVE_TIMEOUT``.
* Each rank writes ``logs/rank-<r>.json`` (exit status, error line, time, whether it only followed another rank's
  failure) as it ends; a rank killed by a signal writes none. That is how the job tells the rank that failed first
  from ranks that failed after it (a collective whose peer is gone fails only once the peer's process is gone,
  after its file was written).
* A rank dies with the job (PR_SET_PDEATHSIG on Linux): a kill -9 of the job leaves no rank training on.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path

from snakeshard.errors import SnakeshardError

# Seconds a collective waits for the other ranks before failing: a rank that hangs alive (a dead one is seen by the
# launcher within a second). Long enough for what one rank does alone while the others wait at the next collective:
# building the env, rank 0 writing a checkpoint.
COLLECTIVE_TIMEOUT = 300
LAUNCH_SIGNALS = ("SIGTERM", "SIGINT", "SIGHUP", "SIGQUIT", "SIGUSR1")  # the launcher's, sent on to the ranks
LAUNCHER_PID = "SNAKESHARD_LAUNCHER_PID"  # a rank exits at once when its launcher is already gone
INTERRUPTED = 75  # loop.TrainingInterrupted.exit_code (not imported: it imports torch)


class RankLost(SnakeshardError):
    """A collective failed: another rank is gone (it failed first; its own error names the cause)."""


class World:
    """This process's place among the ranks: rank 0 of 1 unless torch.distributed is initialized. Its collectives
    raise ``RankLost`` when another rank is gone."""

    def __init__(self, rank: int = 0, size: int = 1):
        self.rank, self.size = rank, size

    @classmethod
    def current(cls) -> "World":
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            return cls(dist.get_rank(), dist.get_world_size())
        return cls()

    def gather(self, obj) -> list:
        """Every rank's ``obj`` (picklable), indexed by rank, on every rank."""
        if self.size == 1:
            return [obj]
        import torch.distributed as dist

        out = [None] * self.size
        with self._collective("all_gather_object"):
            dist.all_gather_object(out, obj)
        return out

    def broadcast(self, obj=None):
        """Rank 0's ``obj`` on every rank."""
        if self.size == 1:
            return obj
        import torch.distributed as dist

        box = [obj]
        with self._collective("broadcast_object_list"):
            dist.broadcast_object_list(box, src=0)
        return box[0]

    def broadcast_tensors(self, tensors) -> None:
        """Rank 0's values into ``tensors`` on every rank (in place)."""
        if self.size == 1:
            return
        import torch.distributed as dist

        with self._collective("broadcast"):
            for tensor in tensors:
                dist.broadcast(tensor, src=0)

    def barrier(self) -> None:
        if self.size > 1:
            import torch.distributed as dist

            with self._collective("barrier"):
                dist.barrier()

    def _collective(self, what: str):
        import contextlib

        @contextlib.contextmanager
        def named():
            try:
                yield
            except Exception as e:
                if not peer_gone(e):  # a bug of snakeshard's, not a lost rank: its own traceback says more
                    raise
                first = f"{type(e).__name__}: {e}".splitlines()[0].split(". ")[0][:200]
                raise RankLost(f"{what} across {self.size} ranks failed ({first}): another rank is gone; the log "
                               "has its own error") from e
        return named()


def peer_gone(error: Exception) -> bool:
    """``error`` is a collective's on several ranks that lost a peer (torch's own types, or the transports' words for
    a lost or silent peer: gloo's timeout names its transport too)."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
        return False
    return isinstance(error, getattr(dist, "DistError", ())) or any(
        words in str(error) for words in ("Connection closed by peer", "Connection reset by peer", "gloo/transport",
                                          "NCCL", "ProcessGroup"))


def backend(devices: list[str]) -> str:
    return "nccl" if devices[0].startswith("cuda") else "gloo"


def status_path(run_dir: Path, rank: int) -> Path:
    return Path(run_dir) / "logs" / f"rank-{rank}.json"


def launch(spec: dict, args, run_dir: Path, ranks: int) -> int:
    """Run ``ranks`` rank processes of this training job under torchrun's launcher; the job's exit status."""
    import torch.distributed.run as torchrun
    from torch.distributed.elastic.multiprocessing import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    from snakeshard.core.devices import job_devices

    stage = spec["stage"]
    devices = job_devices(spec.get("gpus", 0), stage)  # refused here, before any rank starts
    shown = devices if devices != ["cpu"] else ["cpu"] * ranks
    for rank in range(ranks):
        status_path(run_dir, rank).unlink(missing_ok=True)  # an earlier attempt's
    print(f"training stage {stage!r}: {ranks} ranks (torchrun, DDP on backend {backend(devices)}), devices {shown}",
          file=sys.stderr, flush=True)
    argv = ["--standalone", "--nproc-per-node", str(ranks), "--max-restarts", "0", "--monitor-interval", "1",
            "--signals-to-handle", ",".join(LAUNCH_SIGNALS),
            "-m", "snakeshard", "train", "--spec", args.spec, "--fingerprint", args.fingerprint, "--rank-worker"]
    os.environ.setdefault("OMP_NUM_THREADS", "1")  # torchrun's own default with N > 1: set here, no banner in the log
    os.environ[LAUNCHER_PID] = str(os.getpid())
    def on_signal(signum, frame):  # before the launcher's own handlers (which raise the same) are in place
        raise SignalException(f"process {os.getpid()} got {signal.Signals(signum).name}", sigval=signal.Signals(signum))

    previous = {sig: signal.signal(sig, on_signal) for sig in (getattr(signal, name) for name in LAUNCH_SIGNALS)}
    latest = Path(run_dir) / "checkpoints" / "latest.pt"
    try:
        torchrun.run(torchrun.parse_args(argv))
        return 0
    except SignalException as e:
        stopped = [r for r, s in _statuses(run_dir, range(ranks)).items() if s.get("exit") == INTERRUPTED]
        how = (f"the {ranks} ranks stopped at a step boundary after a checkpoint" if len(stopped) == ranks else
               f"ranks {sorted(set(range(ranks)) - set(stopped))} ended without stopping at a step boundary "
               "(not training yet, or killed after the launcher's shutdown timeout)")
        print(f"training stage {stage!r}: {e.sigval.name}: {how}; a rerun resumes from {latest}",
              file=sys.stderr, flush=True)
        return INTERRUPTED
    except ChildFailedError as e:
        return _failed(stage, e.failures, run_dir, ranks, latest)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _failed(stage: str, failures: dict, run_dir: Path, ranks: int, latest: Path) -> int:
    """INTERRUPTED when every failed rank stopped on a signal after the checkpoint; else raises naming the rank that
    failed first: one that ended without its status file (a signal, a crash), else the earliest status file's."""
    statuses = _statuses(run_dir, failures)
    failed = sorted(failures)
    if all(statuses.get(r, {}).get("exit") == INTERRUPTED for r in failed):
        print(f"training stage {stage!r}: the {ranks} ranks stopped on a signal after a checkpoint ({latest}); "
              "rerun to resume", file=sys.stderr, flush=True)
        return INTERRUPTED
    # The launcher stops the other ranks with SIGTERM, and under load its poll can see one of them gone too (a suite
    # run named rank 0's SIGTERM for a kill -9 of rank 1): a rank dead of another cause comes first.
    silent = sorted((r for r in failed if r not in statuses),
                    key=lambda r: (failures[r].exitcode == -signal.SIGTERM, r))
    own = [r for r in failed if r in statuses and not statuses[r].get("follows")] or failed
    root = silent[0] if silent else min(own, key=lambda r: (statuses[r].get("time", 0), r))
    failure = failures[root]
    if root in statuses:  # the exit code it wrote: the launcher may have seen the SIGTERM it sent as the rank left
        status = statuses[root]
        how = f"failed (exit code {status.get('exit', 1)}): {status.get('error') or 'no error message'}"
    elif failure.exitcode < 0:
        how = f"died of {failure.signal_name()} (exit code {failure.exitcode}, pid {failure.pid})"
    else:
        how = f"ended with exit code {failure.exitcode} (pid {failure.pid}) without an error message"
    if root in statuses:  # its own error says what to do
        raise SnakeshardError(f"stages.{stage}: rank {root} of {ranks} {how}; the other ranks were stopped")
    resume = (f"a rerun resumes from {latest}" if latest.exists()
              else "no checkpoint was written yet: a rerun starts from the first step")
    raise SnakeshardError(f"stages.{stage}: rank {root} of {ranks} {how}; the other ranks were stopped, and {resume}")


def _statuses(run_dir: Path, ranks) -> dict[int, dict]:
    """The status files of ``ranks`` that wrote one."""
    found = {}
    for rank in ranks:
        try:
            found[rank] = json.loads(status_path(run_dir, rank).read_text())
        except (OSError, ValueError):
            pass
    return found


def run_rank(spec: dict, run_dir: Path, body) -> int:
    """One rank process: joins the process group (backend for the job's devices, ``COLLECTIVE_TIMEOUT``), runs
    ``body(world, device)`` and writes its status file as it ends, before it leaves the group."""
    import datetime

    import torch.distributed as dist

    from snakeshard.core.devices import job_devices

    _die_with_launcher()
    rank, size, local = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), int(os.environ["LOCAL_RANK"])
    status = {"rank": rank, "exit": 1, "error": None}
    try:
        devices = job_devices(spec.get("gpus", 0), spec["stage"])
        device = devices[local] if devices != ["cpu"] else "cpu"
        if device != "cpu":
            import torch

            torch.cuda.set_device(device)
        dist.init_process_group(backend(devices), timeout=datetime.timedelta(seconds=COLLECTIVE_TIMEOUT))
        status["exit"] = body(World(rank, size), device)
        return status["exit"]
    except SnakeshardError as e:
        status["error"] = " ".join(str(e).split("\n"))
        status["follows"] = isinstance(e, RankLost)  # stopped because another rank failed first
        raise SnakeshardError(f"rank {rank}: {e}") from e.__cause__
    except BaseException as e:
        status["error"] = f"{type(e).__name__}: {e}".splitlines()[0]
        raise
    finally:
        status["time"] = time.time()
        try:
            from snakeshard.io.atomic import atomic_write_json

            atomic_write_json(status_path(run_dir, rank), status)
        except OSError:  # the job then names this rank as one that ended without a word
            pass
        if dist.is_initialized():
            dist.destroy_process_group()


def _die_with_launcher() -> None:
    """SIGKILL this rank when the process that started it (the job's launcher) ends, even by kill -9."""
    if not sys.platform.startswith("linux"):
        return
    import ctypes

    PR_SET_PDEATHSIG = 1
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    launcher = os.environ.get(LAUNCHER_PID)
    if launcher is not None and os.getppid() != int(launcher):  # it died before the line above
        os._exit(1)
