"""Executors: where a sweep's runs are computed. One interface, two implementations.

* :class:`PoolExecutor` (the default, ``--jobs N``): a local process pool; ``jobs`` 1 runs in this process. Workers
  exit when the sweep's process dies and are killed when it is interrupted (the comparison machinery's worker set-up,
  lab/report/compare.py).
* :class:`RayExecutor` (``--executor ray``): Ray tasks (https://docs.ray.io/en/latest/ray-core/tasks.html), one CPU
  each, on a local Ray instance it starts (``ray.init()``) or on a running cluster (``address``: ``auto`` or
  ``host:port``). Needs the optional ``ray`` package (``pip install 'servelab[ray]'``).

Both run the same module-level task function on the same picklable items, so a run's result does not depend on the
executor. A task's exception is caught on the worker and comes back as a one-line error (:func:`one_line`), never
as a raised exception: a failed task does not stop the others. The executor itself (the pool or the Ray cluster)
failing raises :class:`ExecutorError`.
"""

from __future__ import annotations

import os
import socket
from abc import ABC, abstractmethod
from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Sequence

from lab.report.compare import _sigterm_as_exit, _stop_workers, _worker_init

RAY_INSTALL_HINT = "pip install 'servelab[ray]' (or pip install 'ray>=2.9')"


class ExecutorError(RuntimeError):
    """An executor that cannot start or that broke down (not a task's own failure)."""


@dataclass(frozen=True)
class TaskOutcome:
    """One finished task: ``index`` into the submitted items, ``value`` (the task's return) or ``error`` (a one-line
    ``Type: message``; ``value`` is then None)."""

    index: int
    value: Any = None
    error: str | None = None


def one_line(exc: BaseException, limit: int = 300) -> str:
    """``"Type: message"`` on one line (the message's lines joined with " | "), at most ``limit`` characters."""
    msg = " | ".join(line.strip() for line in str(exc).splitlines() if line.strip())
    text = f"{type(exc).__name__}: {msg}" if msg else type(exc).__name__
    return text if len(text) <= limit else text[: limit - 3] + "..."


def guarded(fn: Callable[[Any], Any], item: Any) -> tuple[Any, str | None]:
    """Worker side: ``(fn(item), None)``, or ``(None, one-line error)`` if it raised an Exception."""
    try:
        return fn(item), None
    except Exception as e:  # noqa: BLE001 - a run's failure is reported, not raised
        return None, one_line(e)


class Executor(ABC):
    """Runs ``fn`` over items on workers. Use as a context manager: the workers start on entry and stop on exit
    (at once, killed, when the block raises, e.g. on Ctrl-C or SIGTERM)."""

    name: str

    @property
    @abstractmethod
    def slots(self) -> int:
        """How many tasks run at once (worker processes, or the Ray cluster's CPUs)."""

    @abstractmethod
    def map_unordered(self, fn: Callable[[Any], Any], items: Sequence[Any],
                      tick_s: float = 1.0) -> Iterator[list[TaskOutcome]]:
        """Submit ``fn(item)`` for every item; yield the outcomes that finished, in completion order, as lists; an
        empty list at least every ``tick_s`` seconds while nothing finishes (for a progress display). ``fn`` must
        be a module-level function and the items picklable.

        Raises:
            ExecutorError: the pool or the cluster failed (a worker process killed from outside, a lost node).
        """

    def __enter__(self) -> "Executor":
        return self

    def __exit__(self, *exc) -> None:
        return None


class PoolExecutor(Executor):
    """A local process pool of ``jobs`` workers (``jobs`` 1: in this process, no pool)."""

    name = "pool"

    def __init__(self, jobs: int = 1) -> None:
        if jobs < 1:
            raise ValueError(f"--jobs: expected a positive number of worker processes, got {jobs}")
        self.jobs = jobs
        self._pool: ProcessPoolExecutor | None = None

    @property
    def slots(self) -> int:
        return self.jobs

    def __exit__(self, exc_type, exc, tb) -> None:
        if self._pool is not None:
            if exc_type is None:
                self._pool.shutdown()
            else:
                _stop_workers(self._pool)
            self._pool = None

    def map_unordered(self, fn, items, tick_s=1.0):
        if self.jobs == 1 or len(items) <= 1:
            for i, item in enumerate(items):
                value, err = guarded(fn, item)
                yield [TaskOutcome(i, value, err)]
            return
        self._pool = ProcessPoolExecutor(max_workers=min(self.jobs, len(items)), initializer=_worker_init,
                                         initargs=(os.getpid(),))
        with _sigterm_as_exit():
            futs = {self._pool.submit(guarded, fn, item): i for i, item in enumerate(items)}
            pending = set(futs)
            while pending:
                finished, pending = wait(pending, timeout=tick_s, return_when=FIRST_COMPLETED)
                yield [self._outcome(futs[f], f) for f in finished]

    @staticmethod
    def _outcome(i: int, fut) -> TaskOutcome:
        try:
            value, err = fut.result()
        except BrokenProcessPool as e:
            raise ExecutorError(f"a worker process died ({one_line(e)}); re-run the sweep to resume") from None
        return TaskOutcome(i, value, err)


class RayExecutor(Executor):
    """Ray tasks of one CPU each. ``address`` None starts a local Ray instance (``num_cpus`` CPUs, default: all);
    ``auto`` or ``host:port`` joins a running cluster (there every node needs servelab installed and the output
    folder on a file system they all share). A Ray session already started in this process is used as it is.
    ``SERVELAB_DATA_DIR``, where set, is set on the workers too (it decides where runs read shared data)."""

    name = "ray"

    def __init__(self, address: str | None = None, num_cpus: int | None = None) -> None:
        try:
            import ray  # noqa: PLC0415 - optional extra
        except ImportError:
            raise ExecutorError(f"--executor ray needs the ray package, which is not installed: {RAY_INSTALL_HINT}") \
                from None
        self._ray = ray
        self.address = address
        self.num_cpus = num_cpus
        self.env = {k: os.environ[k] for k in ("SERVELAB_DATA_DIR",) if k in os.environ}
        self._started = False
        self._refs: list = []

    def __enter__(self) -> "RayExecutor":
        ray = self._ray
        if not ray.is_initialized():
            import logging  # noqa: PLC0415

            kwargs: dict[str, Any] = {"include_dashboard": False, "logging_level": logging.WARNING,
                                      "log_to_driver": False}
            if self.env:
                kwargs["runtime_env"] = {"env_vars": self.env}
            if self.address is None:  # "local": a new instance, even where `ray start` left one (or its file)
                kwargs.update(address="local", num_cpus=self.num_cpus)
            else:
                _check_reachable(self.address)
                kwargs["address"] = self.address
            try:
                ray.init(**kwargs)
            except (ConnectionError, RuntimeError, ValueError) as e:
                where = f"the Ray cluster at {self.address}" if self.address else "a local Ray instance"
                raise ExecutorError(f"--executor ray: cannot start or join {where}: {one_line(e)}") from None
            self._started = True
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is not None:
            for ref in self._refs:
                self._ray.cancel(ref, force=True)
        self._refs = []
        if self._started:
            self._ray.shutdown()
            self._started = False

    @property
    def slots(self) -> int:
        return max(1, int(self._ray.cluster_resources().get("CPU", 1)))

    def map_unordered(self, fn, items, tick_s=1.0):
        ray = self._ray
        task = ray.remote(num_cpus=1)(guarded)
        fn_ref = ray.put(fn)
        index = {}
        for i, item in enumerate(items):
            ref = task.remote(fn_ref, item)
            index[ref] = i
        self._refs = list(index)
        pending = list(index)
        with _sigterm_as_exit():
            while pending:
                ready, pending = ray.wait(pending, num_returns=1, timeout=tick_s)
                if ready and pending:  # drain whatever else finished meanwhile
                    more, pending = ray.wait(pending, num_returns=len(pending), timeout=0)
                    ready += more
                yield [self._outcome(index[ref], ref) for ref in ready]
        self._refs = []

    def _outcome(self, i: int, ref) -> TaskOutcome:
        ray = self._ray
        try:
            value, err = ray.get(ref)
        except ray.exceptions.RayError as e:  # the worker or its node died; the task's own errors come back as err
            return TaskOutcome(i, None, one_line(e))
        return TaskOutcome(i, value, err)


def _check_reachable(address: str, timeout_s: float = 5.0) -> None:
    """For ``host:port``, a TCP connection to the cluster's head first: ``ray.init`` retries an unreachable address
    for minutes. ``auto`` (found by Ray itself) is not checked.

    Raises:
        ExecutorError: not ``auto`` nor ``host:port``, or nothing answers there within ``timeout_s`` seconds.
    """
    if address == "auto":
        return
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ExecutorError(f"--address: expected auto or host:port (the Ray head's GCS port, 6379 by default), "
                            f"got {address!r}")
    try:
        socket.create_connection((host, int(port)), timeout=timeout_s).close()
    except OSError as e:
        raise ExecutorError(f"--address {address}: no Ray cluster answers there ({one_line(e)}); start one with "
                            "`ray start --head` or pass the head's address") from None


def make_executor(kind: str, jobs: int, address: str | None = None) -> Executor:
    """The executor ``kind`` names: ``pool`` (``jobs`` workers) or ``ray`` (``address`` None: a local instance of
    ``jobs`` CPUs).

    Raises:
        ExecutorError: ``ray`` without the ray package, or an unknown kind.
        ValueError: ``jobs`` < 1.
    """
    if kind == "pool":
        if address is not None:
            raise ExecutorError("--address is for --executor ray; the process pool runs on this machine")
        return PoolExecutor(jobs)
    if kind == "ray":
        return RayExecutor(address, jobs)
    raise ExecutorError(f"--executor: expected pool or ray, got {kind!r}")
