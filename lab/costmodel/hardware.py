"""GPU facts from the project's hardware catalog (lab/catalog/hardware.yaml) and from GPUs a user describes.

A user GPU is described with the same fields as a catalog entry, either inline in an experiment
(``hardware.gpu: {name: L40S, bf16_tflops: ...}``) or in a YAML file of entries (``hardware.gpu_catalog``); both
are checked by :func:`gpu_from_entry`, the same check the packaged entries pass, and then registered for this
process (:func:`register_gpu`), so every part of the simulator finds them by name as it finds a catalog GPU.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

from lab.costmodel.catalog import read_catalog
from lab.costmodel.links import LINKS


@dataclass(frozen=True)
class Hardware:
    """Peak figures of one GPU.

    Attributes:
        name: catalog name.
        bf16_flops: dense BF16 tensor-core peak, FLOP/s.
        fp8_flops: dense FP8 peak, FLOP/s (None where the GPU has no FP8 tensor cores).
        memory_bytes: device memory as the CUDA runtime reports it, bytes.
        memory_bandwidth: peak HBM/GDDR bandwidth, B/s.
        link_bandwidth: scale-up interconnect per GPU, one direction, B/s.
        pcie_bandwidth: host link, one direction, B/s.
        num_sms: streaming multiprocessors (AMD: compute units) a GEMM's output tiles are spread over.
        pcie_latency_s: fixed seconds of one host-link copy (catalog ``pcie_latency_us``, optional; default
            :data:`DEFAULT_PCIE_LATENCY_S`).
    """

    name: str
    bf16_flops: float
    fp8_flops: float | None
    memory_bytes: int
    memory_bandwidth: float
    link_bandwidth: float
    pcie_bandwidth: float
    num_sms: int
    pcie_latency_s: float = 10e-6  # = DEFAULT_PCIE_LATENCY_S

    def peak_flops(self, dtype: str) -> float:
        """Dense peak for a GEMM dtype; fp8 falls back to bf16 on GPUs without FP8 tensor cores."""
        if dtype.startswith("fp8") and self.fp8_flops:
            return self.fp8_flops
        return self.bf16_flops


# Fixed cost of one cudaMemcpyAsync over PCIe (launch plus link round trip): an order-of-magnitude figure of several
# microseconds, not a measurement of this project; a catalog entry may set its own ``pcie_latency_us``.
DEFAULT_PCIE_LATENCY_S = 10e-6

BUILTIN_SOURCE = "lab/catalog/hardware.yaml"

# The fields of a catalog entry: name -> (required, what it holds). Numbers must be positive and finite.
GPU_FIELDS: dict[str, tuple[bool, str]] = {
    "bf16_tflops": (True, "dense BF16/FP16 tensor-core peak, TFLOPS (no 2:4 sparsity)"),
    "fp8_tflops": (False, "dense FP8 tensor-core peak, TFLOPS; null or absent: no FP8 tensor cores"),
    "memory_bytes": (True, "device memory as the CUDA runtime reports it (nvidia-smi total), bytes"),
    "memory_bandwidth_tbps": (True, "peak HBM/GDDR bandwidth, TB/s"),
    "link_gbps": (True, "per-GPU scale-up link, one direction, GB/s (the PCIe figure when there is no NVLink)"),
    "pcie_gbps": (True, "host link, one direction, GB/s"),
    "num_sms": (True, "streaming multiprocessors (AMD: compute units)"),
    "link": (True, "intra-node link type, a key of lab/costmodel/comm.py LINKS (e.g. nvlink4, pcie4_p2p)"),
    "gpus_per_node": (False, "GPUs of one server (default 8)"),
    "internode_link": (False, "link type between nodes (default ib_ndr400)"),
    "pcie_latency_us": (False, "fixed microseconds of one host-link copy (default 10)"),
    "fit_proxy": (False, "a packaged GPU of the same silicon whose fitted curves this one borrows"),
    "aliases": (False, "other names it is found by"),
    "sources": (False, "where the figures come from"),
}
_INTEGER_FIELDS = ("memory_bytes", "num_sms", "gpus_per_node")
_LINK_FIELDS = ("link", "internode_link")


class GPUCatalogError(ValueError):
    """A GPU description is incomplete or wrong, a GPU catalog file cannot be read, or a user GPU's name clashes;
    the message is one line naming the file (or field) and the bad field."""


def _positive(value: Any, integer: bool) -> bool:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return False
    if integer and not float(value).is_integer():
        return False
    return math.isfinite(value) and value > 0


def _at(where: str, field: str) -> str:
    return f"{where}.{field}" if where else field


def check_gpu_entry(name: str, entry: Any, where: str) -> dict[str, Any]:
    """Check one GPU description (the fields of :data:`GPU_FIELDS`); returns it unchanged.

    Args:
        name: the GPU's name (the catalog key).
        entry: the mapping of fields.
        where: what the field names are prefixed with in messages, e.g. ``gpus.yaml: L40S`` (giving
            ``gpus.yaml: L40S.num_sms: ...``); empty for none (an experiment's inline GPU, whose message the
            experiment loader prefixes with the file and ``hardware.gpu``).

    Raises:
        GPUCatalogError: ``<where>.<field>: <what is wrong>`` for the first bad, missing or unknown field.
    """
    if not isinstance(entry, dict):
        raise GPUCatalogError(f"{where or 'gpu'}: expected a mapping of GPU fields ({', '.join(GPU_FIELDS)}), got "
                              f"{type(entry).__name__}")
    if not isinstance(name, str) or not name.strip():
        raise GPUCatalogError(f"{_at(where, 'name')}: expected a non-empty GPU name, got {name!r}")
    unknown = sorted(set(entry) - set(GPU_FIELDS) - {"name"})
    if unknown:
        raise GPUCatalogError(f"{_at(where, unknown[0])}: unknown GPU field; expected some of "
                              f"{', '.join(GPU_FIELDS)}")
    for field, (required, what) in GPU_FIELDS.items():
        value = entry.get(field)
        if value is None:
            if required:
                raise GPUCatalogError(f"{_at(where, field)}: missing ({what})")
            continue
        if field in _LINK_FIELDS:
            if value not in LINKS:
                raise GPUCatalogError(f"{_at(where, field)}: {value!r} is not a known link type; expected one of "
                                      f"{', '.join(sorted(LINKS))}")
        elif field == "fit_proxy":
            if value not in _catalog():
                raise GPUCatalogError(f"{_at(where, 'fit_proxy')}: {value!r} is not a packaged GPU; expected one of "
                                      f"{', '.join(sorted(_catalog()))}")
        elif field == "aliases":
            if not isinstance(value, list) or not all(isinstance(a, str) and a for a in value):
                raise GPUCatalogError(f"{_at(where, 'aliases')}: expected a list of names, got {value!r}")
        elif field == "sources":
            if not isinstance(value, str):
                raise GPUCatalogError(f"{_at(where, 'sources')}: expected text, got {value!r}")
        elif not _positive(value, field in _INTEGER_FIELDS):
            kind = "a positive integer" if field in _INTEGER_FIELDS else "a positive number"
            raise GPUCatalogError(f"{_at(where, field)}: must be {kind} ({what}), got {value!r}")
    return entry


def gpu_from_entry(name: str, entry: dict[str, Any], where: str) -> Hardware:
    """A :class:`Hardware` from a catalog entry (TFLOPS, TB/s, GB/s, µs converted to FLOP/s, B/s and s), checked
    by :func:`check_gpu_entry`.

    Raises:
        GPUCatalogError: a missing, unknown or non-positive field (one line naming ``where`` and the field).
    """
    e = check_gpu_entry(name, entry, where)
    return Hardware(
        name=name,
        bf16_flops=float(e["bf16_tflops"]) * 1e12,
        fp8_flops=float(e["fp8_tflops"]) * 1e12 if e.get("fp8_tflops") else None,
        memory_bytes=int(e["memory_bytes"]),
        memory_bandwidth=float(e["memory_bandwidth_tbps"]) * 1e12,
        link_bandwidth=float(e["link_gbps"]) * 1e9,
        pcie_bandwidth=float(e["pcie_gbps"]) * 1e9,
        num_sms=int(e["num_sms"]),
        pcie_latency_s=float(e.get("pcie_latency_us") or DEFAULT_PCIE_LATENCY_S * 1e6) * 1e-6,
    )


@lru_cache(maxsize=1)
def _catalog() -> dict[str, dict[str, Any]]:
    return read_catalog("hardware")


@lru_cache(maxsize=None)
def _packaged(key: str) -> Hardware:
    return gpu_from_entry(key, _catalog()[key], f"{BUILTIN_SOURCE}: {key}")


# GPUs described by users in this process: name -> (entry, where it was described, its Hardware).
_USER: dict[str, tuple[dict[str, Any], str, Hardware]] = {}


def _find(name: str) -> tuple[str, dict[str, Any], str] | None:
    """(key, entry, where it was described) of a packaged or user GPU called ``name`` or aliased so, or None."""
    for key, e in _catalog().items():
        if name == key or name in (e.get("aliases") or []):
            return key, e, BUILTIN_SOURCE
    for key, (e, where, _) in _USER.items():
        if name == key or name in (e.get("aliases") or []):
            return key, e, where
    return None


def _figures(entry: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in entry.items() if k not in ("name", "sources")}


def register_gpu(name: str, entry: dict[str, Any], where: str, origin: str | None = None) -> Hardware:
    """Check a user GPU and make it known by name (and aliases) to this process, as a packaged GPU is.

    Describing the same name again with the same figures is a no-op (an experiment is parsed more than once);
    ``name`` and ``sources`` do not count as figures.

    Args:
        name: the GPU's name.
        entry: its fields (:data:`GPU_FIELDS`; units as in lab/catalog/hardware.yaml).
        where: prefix of field names in messages (``gpus.yaml: L40S``; empty: none).
        origin: where it is described, named when a later description clashes (default ``where``).

    Raises:
        GPUCatalogError: a bad field; a name or alias that is a packaged GPU's; a name already described in this
            process with other figures (each variant needs its own name).
    """
    hw = gpu_from_entry(name, entry, where)
    origin = origin or where or "an inline description"
    for n in (name, *(entry.get("aliases") or [])):
        found = _find(n)
        if found is None:
            continue
        key, old, old_origin = found
        if old_origin == BUILTIN_SOURCE:
            raise GPUCatalogError(f"{_at(where, 'name') if n == name else _at(where, 'aliases')}: {n!r} is a "
                                  f"packaged GPU ({BUILTIN_SOURCE}: {key}); give yours another name")
        if key != name or _figures(old) != _figures(entry):
            raise GPUCatalogError(f"{_at(where, 'name')}: GPU {n!r} is already described with other figures by "
                                  f"{old_origin}; give each description its own name")
    if name not in _USER:
        _USER[name] = (dict(entry), origin, hw)
    return _USER[name][2]


def load_gpu_catalog(path: str | Path) -> list[str]:
    """Read a user GPU catalog (a YAML mapping of GPU name -> fields, as lab/catalog/hardware.yaml) and register
    every entry (:func:`register_gpu`); returns their names in file order.

    Raises:
        GPUCatalogError: the file is missing, not YAML or not a mapping, or an entry is bad (one line naming the
            file, the GPU and the field, e.g. ``gpus.yaml: L40S.memory_bandwidth_tbps: must be a positive number``).
    """
    import yaml  # noqa: PLC0415

    p = Path(path)
    if not p.is_file():
        raise GPUCatalogError(f"{p}: GPU catalog file does not exist")
    try:
        data = yaml.safe_load(p.read_text())
    except yaml.YAMLError as e:
        raise GPUCatalogError(f"{p}: not valid YAML: {' '.join(str(e).split())}") from None
    if not isinstance(data, dict) or not data:
        raise GPUCatalogError(f"{p}: expected a mapping of GPU name -> fields (as lab/catalog/hardware.yaml)")
    for name, entry in data.items():
        register_gpu(str(name), entry, f"{p}: {name}", str(p))
    return [str(n) for n in data]


def forget_user_gpus() -> None:
    """Drop every user GPU registered in this process (for tests)."""
    _USER.clear()


def hardware_names() -> list[str]:
    """Names of the packaged GPUs (lab/catalog/hardware.yaml)."""
    return sorted(_catalog())


def user_gpu_names() -> list[str]:
    """Names of the user GPUs registered in this process."""
    return sorted(_USER)


def hardware_entry(name: str) -> dict[str, Any]:
    """The catalog entry (link types, gpus_per_node, fit_proxy, ...) of a packaged or user GPU.

    Raises:
        ValueError: unknown name; the message lists the known GPUs.
    """
    found = _find(name)
    if found is None:
        load_hardware(name)  # raises, listing the catalog
    return found[1]  # type: ignore[index]


def load_hardware(name: str) -> Hardware:
    """Look a GPU up by name or alias: a packaged one (lab/catalog/hardware.yaml) or a user GPU registered in this
    process (:func:`register_gpu`).

    Raises:
        ValueError: unknown name; the message lists the known GPUs.
        GPUCatalogError: a packaged entry with a bad field (one line naming the file, the GPU and the field).
    """
    found = _find(name)
    if found is None:
        known = ", ".join(sorted(_catalog()) + sorted(_USER))
        raise ValueError(f"hardware {name!r} is not in the catalog; known: {known} (or describe your GPU: "
                         "hardware.gpu as a mapping of its figures, or hardware.gpu_catalog)")
    key, _, origin = found
    return _packaged(key) if origin == BUILTIN_SOURCE else _USER[key][2]


def fit_proxy(name: str) -> Hardware | None:
    """The GPU whose fitted efficiency curves ``name`` borrows (catalog field ``fit_proxy``: same silicon, e.g.
    H800 -> H100), or None."""
    proxy = hardware_entry(name).get("fit_proxy")
    return load_hardware(proxy) if proxy else None
