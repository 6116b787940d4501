"""Several devices or CPU workers inside one process's job: easycore's runner API, without its hangs.

Subclass ``OrderedRunner`` (results reach the consumer in input order) or ``UnorderedRunner`` (in
completion order) and write six static hooks, as in ``easycore.common.parallel``::

    producer_init(device, cfg)        once per worker process (load the model onto ``device`` into cfg)
    producer_work(device, cfg, data)  per item, in the worker; returns the item's result
    producer_end(device, cfg)         once per worker, when the pool closes
    consumer_init(cfg)                once per call, in the calling process
    consumer_work(cfg, result)        per result, in the calling process
    consumer_end(cfg)                 once per call; its value is what ``runner(data_iter)`` returns

``devices`` is a count of CPU workers (``2`` -> ``["cpu", "cpu"]``) or a list of device strings
(``["cuda:0", "cuda:1"]``); a bare string is refused (easycore would start one worker per character).
``cfg`` is any picklable object (a dict becomes a ``Cfg``, a namespace with attribute and item access);
each worker gets its own copy, the consumer hooks the caller's.

What never hangs, and how:

* Workers are spawned (no fork: CUDA-safe) and each talks to the caller over its own two pipes, so a
  worker killed mid-write (SIGKILL, the OOM killer) cannot leave a lock held that the others need.
* The caller waits on the pipes and the processes' sentinels together, 0.1 s at a time: a worker that
  raises is reported with the item, the device and its traceback; one that dies is reported with its
  exit code or signal and the item it held; the other workers are then terminated. Both within a second.
* ``item_timeout`` (seconds) fails the call naming the item and device when one item takes longer. Its
  clock starts when a worker is ready: start-up (loading a model) may take many items' time.
* ``init_timeout`` (seconds) fails the call naming the worker and device when a worker is still in
  ``producer_init`` that long after it was started (a stuck model load, a hung download). None (the
  default): no limit. Both are checked while a call runs, every 0.1 s.
* A consumer hook that raises propagates; the workers are terminated first.
* At most ``prefetch`` items wait at each worker (``queue_scale``, 3 by default), and an ordered run
  dispatches at most ``window`` items past the oldest unfinished one, which bounds its reorder buffer.
* ``close()`` is idempotent, waits ``close_timeout`` seconds for ``producer_end`` and then terminates;
  a pool that is garbage-collected or left open at exit is closed the same way (``weakref.finalize``).

Items go to workers over a pipe, so keep them small (keys, paths); results may be large (arrays).
"""

from __future__ import annotations

import multiprocessing
import signal
import time
import traceback
import types
import weakref
from collections import deque
from multiprocessing.connection import wait

from snakeshard.errors import SnakeshardError

POLL_S = 0.1  # how often the caller looks at its workers while none has anything to say


class PoolError(SnakeshardError):
    """A worker failed: it raised, died or timed out. Names the device, the item and what happened; for an exception
    raised in the worker, its traceback follows (``worker_traceback``), and ``line`` is the message in one line ending
    with the exception (a shard job's error line: the cause, not ``raised:`` and a cut)."""

    def __init__(self, message: str, worker_traceback: str | None = None):
        self.worker_traceback = worker_traceback
        last = (worker_traceback or "").strip().splitlines()[-1:]
        self.line = f"{message}: {last[0]}" if last else message
        super().__init__(f"{message}:\n{worker_traceback}" if worker_traceback else message)


class Cfg(types.SimpleNamespace):
    """easycore's CfgNode in spirit: ``cfg.model = ...`` or ``cfg["model"]``."""

    def __getitem__(self, name):
        return getattr(self, name)

    def __setitem__(self, name, value):
        setattr(self, name, value)

    def __contains__(self, name):
        return hasattr(self, name)

    def get(self, name, default=None):
        return getattr(self, name, default)


def pool_devices(devices) -> list[str]:
    """``devices`` as a list of device strings (an int: that many ``"cpu"``)."""
    if isinstance(devices, str):
        raise TypeError(f"devices={devices!r} is a string: give a list of devices ([{devices!r}]) or a count of "
                        "CPU workers")
    if isinstance(devices, bool) or not isinstance(devices, int) and not hasattr(devices, "__iter__"):
        raise TypeError(f"devices must be a count of CPU workers or a list of device strings, not {devices!r}")
    if isinstance(devices, int):
        if devices < 1:
            raise ValueError(f"devices={devices}: at least one worker")
        return ["cpu"] * devices
    devices = list(devices)
    if not devices or not all(isinstance(d, str) for d in devices):
        raise TypeError(f"devices must be a non-empty list of device strings, got {devices!r}")
    return devices


def _send(conn, message) -> None:
    try:
        conn.send(message)
    except Exception:  # an unpicklable result: say so instead of dying without a word
        conn.send(("error", message[1], f"the result could not be sent to the caller:\n{traceback.format_exc()}"))


def _worker(runner_cls, device: str, cfg, inbox, outbox) -> None:
    """A worker process: producer_init, then producer_work per item until told to stop (or the caller is gone)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the caller's to handle; it stops the workers
    try:
        runner_cls.producer_init(device, cfg)
    except BaseException:
        outbox.send(("init_error", None, traceback.format_exc()))
        return
    outbox.send(("ready", None, None))
    try:
        while True:
            try:
                message = inbox.recv()
            except EOFError:  # the caller is gone
                return
            if message is None:
                return
            seq, data = message
            try:
                result = runner_cls.producer_work(device, cfg, data)
            except BaseException:
                outbox.send(("error", seq, traceback.format_exc()))
                return
            _send(outbox, ("ok", seq, result))
    finally:
        try:
            runner_cls.producer_end(device, cfg)
        except BaseException:
            try:
                outbox.send(("end_error", None, traceback.format_exc()))
            except OSError:
                pass


class _Worker:
    """The caller's handle on one worker: its process, pipes and the items it holds."""

    def __init__(self, index: int, device: str, process, inbox, outbox):
        self.index, self.device, self.process, self.inbox, self.outbox = index, device, process, inbox, outbox
        self.held: deque = deque()  # (seq, item) sent and not answered, oldest first
        self.ready = False
        self.started = time.monotonic()  # init_timeout counts from here (``since`` restarts as items go out)
        self.since = 0.0  # when its oldest held item started (ready, or the previous result came back)

    def __repr__(self) -> str:
        return f"worker {self.index} ({self.device})"


def _exit_reason(process) -> str:
    process.join(1.0)
    code = process.exitcode
    if code is None:
        return "stopped answering"
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        hint = " (the OOM killer sends it; see dmesg)" if -code == signal.SIGKILL else ""
        return f"was killed by {name}{hint}"
    return f"exited with code {code}"


def _stop(workers: list, grace: float) -> None:
    """Ask every worker to end (producer_end), wait up to ``grace`` s, then terminate, then kill."""
    for w in workers:
        try:
            w.inbox.send(None)
        except OSError:
            pass
    deadline = time.monotonic() + grace
    for w in workers:
        w.process.join(max(0.0, deadline - time.monotonic()))
    for w in workers:
        if w.process.is_alive():
            w.process.terminate()
            w.process.join(1.0)
        if w.process.is_alive():
            w.process.kill()
            w.process.join()
        for conn in (w.inbox, w.outbox):
            conn.close()
        w.process.close()


class _Runner:
    ordered = True
    # how errors name start-up and its limit; a subclass may say it in its own users' words (shard_pool: the
    # provider's env and the stage option)
    init_step = "producer_init"
    init_timeout_name = "init_timeout"

    def __init__(self, devices, cfg=None, queue_scale: float = 3.0, *, item_timeout: float | None = None,
                 init_timeout: float | None = None, close_timeout: float = 10.0):
        self.devices = pool_devices(devices)
        self.cfg = Cfg(**cfg) if isinstance(cfg, dict) else (cfg if cfg is not None else Cfg())
        self.prefetch = max(1, int(round(queue_scale)))
        self.window = self.prefetch * len(self.devices) * 2  # ordered: how far past the oldest unfinished item
        self.item_timeout, self.init_timeout, self.close_timeout = item_timeout, init_timeout, close_timeout
        self._workers: list[_Worker] = []
        self._finalizer = None
        self.activate()

    # -- easycore's hooks --
    @staticmethod
    def producer_init(device, cfg):
        pass

    @staticmethod
    def producer_work(device, cfg, data):
        return data

    @staticmethod
    def producer_end(device, cfg):
        pass

    @staticmethod
    def consumer_init(cfg):
        pass

    @staticmethod
    def consumer_work(cfg, data):
        pass

    @staticmethod
    def consumer_end(cfg):
        return None

    # -- life cycle --
    @property
    def is_activate(self) -> bool:
        return bool(self._workers)

    def activate(self) -> None:
        """Start one worker process per device (if not running)."""
        if self._workers:
            return
        ctx = multiprocessing.get_context("spawn")
        workers = []
        for index, device in enumerate(self.devices):
            worker_in, inbox = ctx.Pipe(duplex=False)  # (read end, write end)
            outbox, worker_out = ctx.Pipe(duplex=False)
            process = ctx.Process(target=_worker, args=(type(self), device, self.cfg, worker_in, worker_out),
                                  name=f"snakeshard-pool-{index}-{device}")
            process.start()
            worker_in.close()  # the worker's ends: closed here so a dead worker reads as EOF
            worker_out.close()
            workers.append(_Worker(index, device, process, inbox, outbox))
        self._workers = workers
        self._finalizer = weakref.finalize(self, _stop, workers, self.close_timeout)

    def close(self) -> None:
        """Let every worker run producer_end and stop (terminated after ``close_timeout`` s). Idempotent."""
        self._shutdown(self.close_timeout)

    def _shutdown(self, grace: float) -> None:
        if self._finalizer is not None:
            self._finalizer.detach()
            self._finalizer = None
        workers, self._workers = self._workers, []
        if workers:
            _stop(workers, grace)

    def __enter__(self):
        self.activate()
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- a run --
    def __call__(self, data_iter):
        self.activate()
        try:
            type(self).consumer_init(self.cfg)
            self._run(iter(data_iter))
            return type(self).consumer_end(self.cfg)
        except BaseException:
            self._shutdown(0.0)  # a failed run: stop the workers now, they may be stuck
            raise

    def _run(self, items) -> None:
        workers = self._workers
        reorder: dict[int, object] = {}
        next_seq = next_out = 0
        exhausted = False
        while True:
            # hand out items one at a time, each to the worker holding fewest (4 items, 2 workers: 2 each,
            # not 3 and 1); each holds at most `prefetch`; ordered runs stay within `window`
            while not exhausted and (not self.ordered or next_seq - next_out < self.window):
                w = min(workers, key=lambda w: len(w.held))
                if len(w.held) >= self.prefetch:
                    break
                try:
                    item = next(items)
                except StopIteration:
                    exhausted = True
                    break
                if not w.held:
                    w.since = time.monotonic()
                w.held.append((next_seq, item))
                try:
                    w.inbox.send((next_seq, item))
                except (BrokenPipeError, ConnectionResetError):
                    self._died(w)
                next_seq += 1
            if exhausted and not any(w.held for w in workers):
                return
            by_conn = {w.outbox: w for w in workers}
            by_sentinel = {w.process.sentinel: w for w in workers}
            ready = wait([*by_conn, *by_sentinel], timeout=POLL_S)
            for conn in ready:
                if conn not in by_conn:
                    continue  # a sentinel: its pipe says EOF too, or the check below catches it
                w = by_conn[conn]
                try:
                    kind, seq, payload = conn.recv()
                except (EOFError, OSError):
                    self._died(w)
                if kind == "ready":
                    w.ready, w.since = True, time.monotonic()
                elif kind == "init_error":
                    raise PoolError(f"{w} failed to start: producer_init raised", payload)
                elif kind == "error":
                    item = next((i for s, i in w.held if s == seq), None)
                    raise PoolError(f"{w} failed on item {item!r}: producer_work raised", payload)
                elif kind == "end_error":
                    raise PoolError(f"{w}: producer_end raised", payload)
                else:  # a result
                    w.held.popleft()
                    w.since = time.monotonic()
                    if self.ordered:
                        reorder[seq] = payload
                        while next_out in reorder:
                            type(self).consumer_work(self.cfg, reorder.pop(next_out))
                            next_out += 1
                    else:
                        type(self).consumer_work(self.cfg, payload)
            for w in workers:
                if not w.process.is_alive() and not w.outbox.poll():
                    self._died(w)
                if self.item_timeout and w.held and w.ready and time.monotonic() - w.since > self.item_timeout:
                    raise PoolError(f"{w}: item {w.held[0][1]!r} is still running after {self.item_timeout:g} s "
                                    "(item_timeout): stopping the pool")
                if self._init_overdue(w):
                    raise PoolError(f"{w} is still starting ({self.init_step}) after {self.init_timeout:g} s "
                                    f"({self.init_timeout_name}): stopping the pool")

    def _init_overdue(self, w: _Worker) -> bool:
        """``w`` has not said ready within init_timeout (a ready just sent and not yet read does not count)."""
        return (bool(self.init_timeout) and not w.ready and time.monotonic() - w.started > self.init_timeout
                and not w.outbox.poll())

    def _died(self, w: _Worker):
        what = f"while holding item {w.held[0][1]!r}" if w.held else "before it was given an item"
        if not w.ready:
            what = f"while starting ({self.init_step})"
        raise PoolError(f"{w} {_exit_reason(w.process)} {what}")


class OrderedRunner(_Runner):
    """Results reach ``consumer_work`` in the order of ``data_iter``."""

    ordered = True


class UnorderedRunner(_Runner):
    """Results reach ``consumer_work`` as workers finish them (each exactly once)."""

    ordered = False
