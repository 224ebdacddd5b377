"""The packaged catalogs (``lab/catalog/*.yaml``: GPUs and links, model architectures), read as YAML."""

from __future__ import annotations

from importlib import resources
from typing import Any

import yaml

# libyaml's C parser when PyYAML was built with it (its wheels are): the same values as the pure-Python SafeLoader
# (tests/test_catalog_yaml.py), about 10x faster; the two catalogs took ~24 ms of every process's start-up before.
_LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)


def read_catalog(name: str) -> dict[str, Any]:
    """The packaged catalog ``lab/catalog/<name>.yaml`` (``hardware`` or ``models``) as a dict.

    Raises:
        FileNotFoundError: no such catalog.
    """
    text = resources.files("lab").joinpath(f"catalog/{name}.yaml").read_text(encoding="utf-8")
    return yaml.load(text, Loader=_LOADER)
