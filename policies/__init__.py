"""Scheduling policies and their registry.

A policy is a class with a ``schedule(engine) -> SchedulerOutput`` method (see lab/sched_api.py). Built-in policies
are registered by name below; a user's own policy is loaded from a file with ``path/to/file.py:ClassName``.
"""

from __future__ import annotations

import importlib.util
import inspect
from pathlib import Path
from typing import Callable

from lab.sched_api import Router, Scheduler
from policies.routers import RoundRobinRouter
from policies.vllm_v1 import VLLMV1Scheduler

_REGISTRY: dict[str, Callable[[], Scheduler]] = {
    "vllm_v1": VLLMV1Scheduler,
}


_ROUTERS: dict[str, Callable[[], Router]] = {
    "round_robin": RoundRobinRouter,
}


class PolicyError(ValueError):
    """An unknown policy name, or a user policy file that cannot be loaded."""


def scheduler_names() -> list[str]:
    return sorted(_REGISTRY)


def router_names() -> list[str]:
    return sorted(_ROUTERS)


def describe() -> dict[str, str]:
    """Name -> first line of the scheduler's docstring."""
    return {n: (inspect.getdoc(c) or "").splitlines()[0] for n, c in sorted(_REGISTRY.items())}


def describe_routers() -> dict[str, str]:
    """Name -> first line of the router's docstring."""
    return {n: (inspect.getdoc(c) or "").splitlines()[0] for n, c in sorted(_ROUTERS.items())}


def make_router(name: str) -> Router:
    """Build a router by registry name.

    Raises:
        PolicyError: unknown name.
    """
    factory = _ROUTERS.get(name)
    if factory is None:
        raise PolicyError(f"cluster.router: unknown router {name!r}; known: {', '.join(router_names())}")
    return factory()


def register(name: str, factory: Callable[[], Scheduler]) -> None:
    """Add a scheduler factory under ``name`` (overrides an existing entry)."""
    _REGISTRY[name] = factory


def make_scheduler(spec: str, base_dir: Path | None = None) -> Scheduler:
    """Build a scheduler from a registry name or ``path/to/file.py:ClassName``.

    Raises:
        PolicyError: unknown name, missing file or class, a class without ``schedule``, or an import error (the
            message names the file).
    """
    if ":" in spec and spec.split(":", 1)[0].endswith(".py"):
        file, cls_name = spec.rsplit(":", 1)
        path = Path(file)
        if not path.is_absolute() and base_dir is not None:
            path = base_dir / path
        if not path.is_file():
            raise PolicyError(f"policy.scheduler: file {path} does not exist")
        mod_name = f"servelab_user_policy_{abs(hash(str(path.resolve())))}"
        spec_ = importlib.util.spec_from_file_location(mod_name, path)
        module = importlib.util.module_from_spec(spec_)  # type: ignore[arg-type]
        try:
            spec_.loader.exec_module(module)  # type: ignore[union-attr]
        except Exception as e:  # a user's file may raise anything at import
            raise PolicyError(f"policy.scheduler: importing {path} failed: {type(e).__name__}: {e}") from e
        cls = getattr(module, cls_name, None)
        if cls is None:
            raise PolicyError(f"policy.scheduler: {path} has no class {cls_name!r}")
        try:
            obj = cls()
        except Exception as e:
            raise PolicyError(f"policy.scheduler: {path}:{cls_name}() failed: {type(e).__name__}: {e}") from e
        if not callable(getattr(obj, "schedule", None)):
            raise PolicyError(f"policy.scheduler: {path}:{cls_name} has no schedule(engine) method")
        return obj
    factory = _REGISTRY.get(spec)
    if factory is None:
        raise PolicyError(f"policy.scheduler: unknown scheduler {spec!r}; known: {', '.join(scheduler_names())} "
                          "(or path/to/file.py:ClassName)")
    return factory()
