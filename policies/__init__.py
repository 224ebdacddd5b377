"""Scheduling policies, routers and their registry (docs/policies.md is the plug-in contract).

A scheduler is a subclass of ``SchedulerBase`` with ``schedule(engine) -> SchedulerOutput`` (see
lab/core/sched_api.py); a router is a subclass of ``RouterBase`` with ``route(request, instances, now) -> int``.
Either may declare its options as a nested pydantic model ``Options`` (validated from ``policy.options`` /
``cluster.router_options``; unknown keys are errors) and then takes the validated options as its one constructor
argument; an ``Options`` field named ``seed`` left unset gets
the experiment's seed. Built-ins are registered by name below; a user's own class is loaded from a file with
``path/to/file.py:ClassName`` (relative to the experiment file).
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import sys
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ValidationError

from lab.core.sched_api import Router, RouterBase, Scheduler, SchedulerBase

# Built-ins by name: a class, or "module:Class" imported the first time it is asked for (a run imports only the
# policies it uses: each module with an options model costs milliseconds of pydantic at start-up).
_REGISTRY: dict[str, type | str] = {
    "vllm_v1": "policies.vllm_v1:VLLMV1Scheduler",
    "vllm_v0": "policies.vllm_v0:VLLMV0Scheduler",
    "sarathi": "policies.sarathi:SarathiScheduler",
    "orca": "policies.orca:OrcaScheduler",
    "static": "policies.static_batching:StaticBatchingScheduler",
    "sglang": "policies.sglang:SGLangScheduler",
    "sjf": "policies.sjf:SJFScheduler",
}

_ROUTERS: dict[str, type | str] = {
    "round_robin": "policies.routers:RoundRobinRouter",
    "least_requests": "policies.routers:LeastRequestsRouter",
    "least_tokens": "policies.routers:LeastTokensRouter",
    "power_of_two": "policies.routers:PowerOfTwoRouter",
    "prefix_aware": "policies.routers:PrefixAwareRouter",
    "session_affinity": "policies.routers:SessionAffinityRouter",
}


def _resolved(table: dict[str, type | str], name: str) -> type | None:
    """The class registered under ``name`` in ``table`` (imported on first use and kept), or None."""
    entry = table.get(name)
    if isinstance(entry, str):
        module, cls_name = entry.split(":")
        entry = table[name] = getattr(importlib.import_module(module), cls_name)
    return entry


class PolicyError(ValueError):
    """An unknown policy name, a user policy file that cannot be loaded, or bad policy options."""


def scheduler_names() -> list[str]:
    return sorted(_REGISTRY)


def router_names() -> list[str]:
    return sorted(_ROUTERS)


def _first_line(cls: type) -> str:
    return (inspect.getdoc(cls) or "").splitlines()[0] if inspect.getdoc(cls) else ""


def describe() -> dict[str, str]:
    """Scheduler name -> first line of its docstring."""
    return {n: _first_line(scheduler_class(n)) for n in scheduler_names()}


def describe_routers() -> dict[str, str]:
    """Router name -> first line of its docstring."""
    return {n: _first_line(router_class(n)) for n in router_names()}


def options_of(cls: type) -> dict[str, tuple[Any, str]]:
    """A policy class's options: name -> (default, description); empty when it takes none."""
    model = getattr(cls, "Options", None)
    if not (isinstance(model, type) and issubclass(model, BaseModel)):
        return {}
    return {n: (f.get_default(call_default_factory=True), f.description or "") for n, f in model.model_fields.items()}


def scheduler_class(name: str) -> type:
    """The registered scheduler class (KeyError if unknown)."""
    cls = _resolved(_REGISTRY, name)
    if cls is None:
        raise KeyError(name)
    return cls


def router_class(name: str) -> type:
    """The registered router class (KeyError if unknown)."""
    cls = _resolved(_ROUTERS, name)
    if cls is None:
        raise KeyError(name)
    return cls


def register(name: str, factory: type) -> None:
    """Add a scheduler class under ``name`` (overrides an existing entry)."""
    _REGISTRY[name] = factory


def register_router(name: str, factory: type) -> None:
    """Add a router class under ``name`` (overrides an existing entry)."""
    _ROUTERS[name] = factory


_MODULES: dict[tuple[str, float], object] = {}


def _load_user_class(spec: str, base_dir: Path | None, field: str) -> type:
    """Import ``path/to/file.py:ClassName`` (relative to ``base_dir``), cached by path and mtime."""
    file, cls_name = spec.rsplit(":", 1)
    path = Path(file)
    if not path.is_absolute() and base_dir is not None:
        path = base_dir / path
    if not path.is_file():
        raise PolicyError(f"{field}: file {path} does not exist")
    key = (str(path.resolve()), path.stat().st_mtime)
    module = _MODULES.get(key)
    if module is None:
        mod_name = f"servelab_user_policy_{abs(hash(key[0]))}"
        spec_ = importlib.util.spec_from_file_location(mod_name, path)
        if spec_ is None or spec_.loader is None:
            raise PolicyError(f"{field}: {path} cannot be imported as a Python module")
        module = importlib.util.module_from_spec(spec_)
        sys.modules[mod_name] = module  # dataclasses / pydantic models in the file resolve their module
        try:
            spec_.loader.exec_module(module)
        except Exception as e:  # a user's file may raise anything at import
            sys.modules.pop(mod_name, None)
            raise PolicyError(f"{field}: importing {path} failed: {type(e).__name__}: {e}") from e
        _MODULES[key] = module
    cls = getattr(module, cls_name, None)
    if cls is None:
        found = sorted(n for n, v in vars(module).items() if inspect.isclass(v) and v.__module__ == module.__name__)
        raise PolicyError(f"{field}: {path} has no class {cls_name!r} (classes defined there: "
                          f"{', '.join(found) or 'none'})")
    if not inspect.isclass(cls):
        raise PolicyError(f"{field}: {path}:{cls_name} is not a class")
    return cls


def _is_path_spec(spec: str) -> bool:
    return ":" in spec and spec.rsplit(":", 1)[0].endswith(".py")


def _instantiate(cls: type, spec: str, options: dict | None, seed: int | None, field: str, opt_field: str,
                 method: str) -> Any:
    model = getattr(cls, "Options", None)
    options = dict(options or {})
    if isinstance(model, type) and issubclass(model, BaseModel):
        unknown = sorted(set(options) - set(model.model_fields))
        if unknown:
            raise PolicyError(f"{opt_field}: unknown option(s) {', '.join(map(repr, unknown))} for {spec!r}; "
                              f"known: {', '.join(model.model_fields) or 'none'}")
        if "seed" in model.model_fields and options.get("seed") is None and seed is not None:
            options["seed"] = seed
        try:
            opts = model.model_validate(options)
        except ValidationError as e:
            lines = [f"{opt_field}.{'.'.join(str(x) for x in err['loc'])}: {err['msg']} (got {err.get('input')!r})"
                     for err in e.errors()]
            raise PolicyError("; ".join(lines)) from None
        args: tuple = (opts,)
    else:
        if options:
            raise PolicyError(f"{opt_field}: {spec!r} takes no options (got {', '.join(map(repr, options))})")
        args = ()
    try:
        obj = cls(*args)
    except PolicyError:
        raise
    except Exception as e:
        raise PolicyError(f"{field}: {spec}() failed: {type(e).__name__}: {e}") from e
    if not callable(getattr(obj, method, None)):
        raise PolicyError(f"{field}: {spec} has no {method}(...) method")
    if method == "schedule" and not isinstance(obj, SchedulerBase):
        raise PolicyError(f"{field}: {spec} must subclass lab.core.sched_api.SchedulerBase (it declares the "
                          "capabilities the engine reads: supports_async, supports_fast_forward, "
                          "supports_pipelining, make_queue)")
    if method == "route" and not isinstance(obj, RouterBase):
        raise PolicyError(f"{field}: {spec} must subclass lab.core.sched_api.RouterBase (it declares the "
                          "capability the simulation reads: routes_by_arrival_order)")
    return obj


def make_scheduler(spec: str, base_dir: Path | None = None, options: dict | None = None,
                   seed: int | None = 0) -> Scheduler:
    """Build a scheduler from a registry name or ``path/to/file.py:ClassName``, with validated options.

    Raises:
        PolicyError: unknown name, missing file or class, an import error (the message names the file), a class
            without ``schedule``, unknown or invalid options.
    """
    if _is_path_spec(spec):
        cls = _load_user_class(spec, base_dir, "policy.scheduler")
    else:
        cls = _resolved(_REGISTRY, spec)
        if cls is None:
            raise PolicyError(f"policy.scheduler: unknown scheduler {spec!r}; known: {', '.join(scheduler_names())} "
                              "(or path/to/file.py:ClassName)")
    return _instantiate(cls, spec, options, seed, "policy.scheduler", "policy.options", "schedule")


def make_router(spec: str, base_dir: Path | None = None, options: dict | None = None,
                seed: int | None = 0) -> Router:
    """Build a router from a registry name or ``path/to/file.py:ClassName``, with validated options.

    Raises:
        PolicyError: as :func:`make_scheduler`, for ``cluster.router`` / ``cluster.router_options``.
    """
    if _is_path_spec(spec):
        cls = _load_user_class(spec, base_dir, "cluster.router")
    else:
        cls = _resolved(_ROUTERS, spec)
        if cls is None:
            raise PolicyError(f"cluster.router: unknown router {spec!r}; known: {', '.join(router_names())} "
                              "(or path/to/file.py:ClassName)")
    return _instantiate(cls, spec, options, seed, "cluster.router", "cluster.router_options", "route")


def check_scheduler(spec: str, base_dir: Path | None = None, options: dict | None = None) -> None:
    """Raise :class:`PolicyError` if :func:`make_scheduler` would fail."""
    make_scheduler(spec, base_dir, options)


def check_router(spec: str, base_dir: Path | None = None, options: dict | None = None) -> None:
    """Raise :class:`PolicyError` if :func:`make_router` would fail."""
    make_router(spec, base_dir, options)
