"""Executors: where the runs of a comparison, a sweep or a search are computed. One interface, two implementations.

* :class:`PoolExecutor` (the default, ``--jobs N``): a local process pool; ``jobs`` 1 runs in this process. Workers
  exit when the parent process dies (PR_SET_PDEATHSIG on Linux, and a thread watching the parent everywhere) and
  are killed when it is interrupted.
* :class:`RayExecutor` (``servelab sweep --executor ray``): Ray tasks
  (https://docs.ray.io/en/latest/ray-core/tasks.html), one CPU each, on a local Ray instance it starts
  (``ray.init()``) or on a running cluster (``address``: ``auto`` or ``host:port``). Needs the optional ``ray``
  package (``pip install 'servelab[ray]'``).

A caller opens an executor as a context manager, submits a module-level task function with picklable items
(:meth:`Executor.submit`) and takes the outcomes as they finish (:meth:`Executor.finished`), or maps the function
over a list (:meth:`Executor.map_unordered`). The same task function runs either way, so a run's result does not
depend on the executor. A task's exception is caught on the worker and comes back in its :class:`TaskOutcome`, as a
one-line error (:func:`one_line`) and, where it survives pickling, as the exception itself, which
:meth:`TaskOutcome.result` raises: what a failed task means is the caller's to decide (a sweep records it and goes
on, a comparison stops, a search tells a deployment that cannot be built from its own errors). The executor itself
(the pool or the Ray cluster) failing raises :class:`ExecutorError`. While an executor is open, SIGTERM raises
SystemExit(143) in the main thread, so that the workers are stopped before the process ends.
"""

from __future__ import annotations

import os
import pickle
import signal
import socket
import threading
import time
import traceback
from abc import ABC, abstractmethod
from collections import deque
from concurrent.futures import FIRST_COMPLETED, Future, ProcessPoolExecutor, wait
from concurrent.futures.process import BrokenProcessPool
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, replace
from typing import Any, Callable, Iterator, Sequence

from lab.report.output_folder import linux_libc, pid_alive

RAY_INSTALL_HINT = "pip install 'servelab[ray]' (or pip install 'ray>=2.9')"


class ExecutorError(RuntimeError):
    """An executor that cannot start or that broke down (not a task's own failure)."""


class TaskError(RuntimeError):
    """A task's exception that could not come back from its worker (it does not survive pickling), as one line."""


class RemoteTraceback(Exception):
    """The traceback of a task's exception on its worker (the cause :meth:`TaskOutcome.result` raises it with)."""

    def __str__(self) -> str:
        return f'\n"""\n{self.args[0]}"""' if self.args else ""


@dataclass(frozen=True)
class TaskOutcome:
    """One finished task: ``index`` (the task's id from :meth:`Executor.submit`; its position in the items for
    :meth:`Executor.map_unordered`), ``value`` (the task's return) or ``error`` (a one-line ``Type: message``;
    ``value`` is then None) with the ``exception`` itself where it came back, and its ``remote_traceback`` (text)
    when it was raised in another process."""

    index: int
    value: Any = None
    error: str | None = None
    exception: BaseException | None = None
    remote_traceback: str | None = None

    def result(self) -> Any:
        """The task's value, or raise its exception (:class:`TaskError` where it could not come back)."""
        if self.error is None:
            return self.value
        if self.exception is None:
            raise TaskError(self.error)
        if self.remote_traceback:
            raise self.exception from RemoteTraceback(self.remote_traceback)
        raise self.exception


def one_line(exc: BaseException, limit: int = 300) -> str:
    """``"Type: message"`` on one line (the message's lines joined with " | "), at most ``limit`` characters."""
    msg = " | ".join(line.strip() for line in str(exc).splitlines() if line.strip())
    text = f"{type(exc).__name__}: {msg}" if msg else type(exc).__name__
    return text if len(text) <= limit else text[: limit - 3] + "..."


def guarded(fn: Callable[[Any], Any], item: Any, crossing: bool = True) -> TaskOutcome:
    """Worker side: the outcome of ``fn(item)`` (its ``index`` set by the caller). An Exception is caught and comes
    back as one line and, ``crossing`` to another process, as the exception itself where it survives pickling, with
    its traceback as text; in this process (``crossing`` False) as it is."""
    try:
        return TaskOutcome(-1, fn(item))
    except Exception as e:  # noqa: BLE001 - a run's failure is reported, not raised
        if not crossing:
            return TaskOutcome(-1, None, one_line(e), e)
        return TaskOutcome(-1, None, one_line(e), _portable(e), "".join(traceback.format_exception(e)))


def _portable(exc: BaseException) -> BaseException | None:
    """``exc`` if it comes back whole from pickling (as a worker's result must), else None. Raises nothing."""
    try:
        pickle.loads(pickle.dumps(exc))
    except Exception:  # noqa: BLE001 - any failure means it cannot cross
        return None
    return exc


class Executor(ABC):
    """Runs task functions over items on workers. Use as a context manager: the workers start on entry (or with the
    first task) and stop on exit (at once, killed, when the block raises, e.g. on Ctrl-C or SIGTERM)."""

    name: str

    @property
    @abstractmethod
    def slots(self) -> int:
        """How many tasks run at once (worker processes, or the Ray cluster's CPUs; valid once open)."""

    def size_for(self, num_tasks: int) -> None:
        """Size the workers for ``num_tasks`` tasks before submitting them (a pool starts no more workers than
        tasks and runs a single task in this process). Optional: without it the executor takes its whole size."""

    @abstractmethod
    def submit(self, fn: Callable[[Any], Any], item: Any) -> int:
        """Start ``fn(item)`` on a worker (queue it, when every worker is busy) and return the task's id (0, 1, ...
        in submission order). ``fn`` must be a module-level function and ``item`` picklable."""

    @abstractmethod
    def finished(self, timeout: float | None = None) -> list[TaskOutcome]:
        """The outcomes of tasks that finished since the last call, in completion order: waits up to ``timeout``
        seconds (None: for ever) for one; [] when none finished by then or none is in flight. Tasks run in this
        process run here, one per call.

        Raises:
            ExecutorError: the pool or the cluster failed (a worker process killed from outside, a lost node).
        """

    @property
    @abstractmethod
    def pending(self) -> int:
        """Tasks submitted whose outcome has not been taken yet."""

    def map_unordered(self, fn: Callable[[Any], Any], items: Sequence[Any],
                      tick_s: float = 1.0) -> Iterator[list[TaskOutcome]]:
        """Submit ``fn(item)`` for every item (on an executor with no other task in flight); yield the outcomes
        that finished, in completion order, as lists, their ``index`` the item's position; an empty list at least
        every ``tick_s`` seconds while nothing finishes (for a progress display).

        Raises:
            ExecutorError: the pool or the cluster failed.
        """
        self.size_for(len(items))
        position = {self.submit(fn, item): i for i, item in enumerate(items)}
        while self.pending:
            yield [replace(out, index=position[out.index]) for out in self.finished(tick_s)]

    def start(self) -> None:
        """Start the workers (on entry); by default they start with the first task."""

    @abstractmethod
    def stop(self, failed: bool) -> None:
        """Stop the workers (on exit): let them finish, or, ``failed``, kill them and drop the tasks not started."""

    def __enter__(self) -> "Executor":
        with ExitStack() as stack:
            stack.enter_context(_sigterm_as_exit())
            self.start()
            self._signals = stack.pop_all()
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        with self._signals:
            self.stop(failed=exc_type is not None)


class PoolExecutor(Executor):
    """A local process pool of ``jobs`` workers (``jobs`` 1, or a single task: in this process, no pool)."""

    name = "pool"

    def __init__(self, jobs: int = 1) -> None:
        if jobs < 1:
            raise ValueError(f"--jobs: expected a positive number of worker processes, got {jobs}")
        self.jobs = jobs
        self._workers = jobs
        self._pool: ProcessPoolExecutor | None = None
        self._futures: dict[Future, int] = {}
        self._queued: deque[tuple[int, Callable[[Any], Any], Any]] = deque()
        self._next_id = 0

    @property
    def slots(self) -> int:
        return self.jobs

    @property
    def pending(self) -> int:
        return len(self._queued) + len(self._futures)

    def size_for(self, num_tasks: int) -> None:
        self._workers = max(1, min(self.jobs, num_tasks))

    def submit(self, fn, item) -> int:
        task_id = self._next_id
        self._next_id += 1
        if self._workers == 1:
            self._queued.append((task_id, fn, item))
        else:
            self._futures[self._started_pool().submit(guarded, fn, item)] = task_id
        return task_id

    def finished(self, timeout=None) -> list[TaskOutcome]:
        if self._queued:
            task_id, fn, item = self._queued.popleft()
            return [replace(guarded(fn, item, crossing=False), index=task_id)]
        if not self._futures:
            return []
        done, _ = wait(list(self._futures), timeout=timeout, return_when=FIRST_COMPLETED)
        return [self._outcome(self._futures.pop(f), f) for f in done]

    def stop(self, failed: bool) -> None:
        self._queued.clear()
        self._futures = {}
        if self._pool is not None:
            if failed:
                _stop_workers(self._pool)
            else:
                self._pool.shutdown()
            self._pool = None

    def _started_pool(self) -> ProcessPoolExecutor:
        if self._pool is None:
            self._pool = ProcessPoolExecutor(max_workers=self._workers, initializer=_worker_init,
                                             initargs=(os.getpid(),))
        return self._pool

    @staticmethod
    def _outcome(task_id: int, fut: Future) -> TaskOutcome:
        try:
            out = fut.result()
        except BrokenProcessPool as e:
            raise ExecutorError(f"a worker process died ({one_line(e)}); run the same command again to resume") \
                from None
        return replace(out, index=task_id)


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
        self._task = None
        self._functions: dict[Callable, Any] = {}  # task function -> its object reference
        self._refs: dict[Any, int] = {}  # task in flight -> its id
        self._next_id = 0

    @property
    def slots(self) -> int:
        return max(1, int(self._ray.cluster_resources().get("CPU", 1)))

    @property
    def pending(self) -> int:
        return len(self._refs)

    def start(self) -> None:
        ray = self._ray
        if ray.is_initialized():
            return
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

    def submit(self, fn, item) -> int:
        ray = self._ray
        if self._task is None:
            self._task = ray.remote(num_cpus=1)(guarded)
        if fn not in self._functions:
            self._functions[fn] = ray.put(fn)
        task_id = self._next_id
        self._next_id += 1
        self._refs[self._task.remote(self._functions[fn], item)] = task_id
        return task_id

    def finished(self, timeout=None) -> list[TaskOutcome]:
        ray = self._ray
        pending = list(self._refs)
        if not pending:
            return []
        ready, pending = ray.wait(pending, num_returns=1, timeout=timeout)
        if ready and pending:  # drain whatever else finished meanwhile
            more, pending = ray.wait(pending, num_returns=len(pending), timeout=0)
            ready += more
        return [self._outcome(self._refs.pop(ref), ref) for ref in ready]

    def stop(self, failed: bool) -> None:
        if failed:
            for ref in self._refs:
                self._ray.cancel(ref, force=True)
        self._refs = {}
        self._functions = {}
        if self._started:
            self._ray.shutdown()
            self._started = False

    def _outcome(self, task_id: int, ref) -> TaskOutcome:
        ray = self._ray
        try:
            out = ray.get(ref)
        except ray.exceptions.RayError as e:  # the worker or its node died; the task's own errors come back in out
            return TaskOutcome(task_id, None, one_line(e))
        return replace(out, index=task_id)


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


# ----------------------------------------------------------------------------------- worker processes and signals

def _worker_init(parent_pid: int) -> None:
    """Pool initializer: the worker exits when the parent process dies (PR_SET_PDEATHSIG on Linux, and a daemon
    thread watching the parent everywhere) and leaves Ctrl-C to it. Raises nothing."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent stops the workers
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    libc = linux_libc()
    if libc is not None:
        pr_set_pdeathsig = 1
        libc.prctl(pr_set_pdeathsig, int(signal.SIGKILL), 0, 0, 0)
    ppid = os.getppid()
    if not pid_alive(parent_pid):
        os._exit(1)
    threading.Thread(target=_watch_parent, args=(parent_pid, ppid), daemon=True, name="servelab-watch-parent").start()


def _watch_parent(parent_pid: int, ppid: int) -> None:
    """Exit this worker at once when its parent changes (re-parented: the parent died) or the parent process is
    gone."""
    while True:
        time.sleep(0.25)
        if os.getppid() != ppid or not pid_alive(parent_pid):
            os._exit(1)


def _stop_workers(pool: ProcessPoolExecutor) -> None:
    """Terminate the pool's worker processes (SIGTERM, then SIGKILL after 2 s) and drop its queued tasks."""
    procs = list((getattr(pool, "_processes", None) or {}).values())
    for p in procs:
        if p.is_alive():
            p.terminate()
    pool.shutdown(wait=False, cancel_futures=True)
    for p in procs:
        p.join(2.0)
        if p.is_alive():
            p.kill()
            p.join(1.0)


@contextmanager
def _sigterm_as_exit():
    """Within the block, SIGTERM raises SystemExit(143) in the main thread (so the workers are stopped before the
    process ends); elsewhere, or off the main thread, nothing changes."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum, frame):
        raise SystemExit(128 + signum)

    previous = signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)
