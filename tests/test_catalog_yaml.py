"""The packaged catalogs read with libyaml's C parser give what the pure-Python loader gives."""

from importlib import resources

import pytest
import yaml

from lab.costmodel.catalog import read_catalog


@pytest.mark.parametrize("name", ["hardware", "models"])
def test_the_catalogs_read_as_the_pure_python_loader_reads_them(name):
    text = resources.files("lab").joinpath(f"catalog/{name}.yaml").read_text(encoding="utf-8")
    assert read_catalog(name) == yaml.safe_load(text)


def test_an_unknown_catalog_is_an_error():
    with pytest.raises(FileNotFoundError):
        read_catalog("gpus")
