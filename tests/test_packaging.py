"""Package metadata: one version, and a build requirement that can read it."""
import os
import re
import tomllib

import fastloader

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_version_is_written_once_and_read_by_the_build():
    from setuptools.config.pyprojecttoml import read_configuration

    config = read_configuration(os.path.join(ROOT, "pyproject.toml"), expand=True)
    assert "version" in config["project"]["dynamic"]
    assert config["project"]["version"] == fastloader.__version__
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        assert "version" not in tomllib.load(f)["project"], "a second, static version"


def test_build_requires_a_setuptools_that_knows_spdx_licenses():
    # `license = "BSD-3-Clause"` (a PEP 639 string) needs setuptools >= 77
    with open(os.path.join(ROOT, "pyproject.toml")) as f:
        text = f.read()
    assert re.search(r'(?m)^license = "', text)
    assert '"setuptools>=77"' in text
    with open(os.path.join(ROOT, "requirements-dev.txt")) as f:
        assert "setuptools>=77" in f.read().split()
