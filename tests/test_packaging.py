"""A non-editable install carries conf/ inside the package and finds it there."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.skipif(importlib.util.find_spec("setuptools") is None, reason="setuptools is needed to build a wheel")
def test_wheel_contains_conf_and_finds_it(tmp_path):
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(tmp_path), str(ROOT)],
        check=True, capture_output=True, timeout=300,
    )
    wheel = next(tmp_path.glob("specgen-*.whl"))
    names = zipfile.ZipFile(wheel).namelist()
    for expected in ("specgen/conf/config.yaml", "specgen/conf/target/smollm2-135m.yaml",
                     "specgen/conf/stack/default.yaml", "specgen/conf/drafter/ngram.yaml"):
        assert expected in names
    site = tmp_path / "site"
    zipfile.ZipFile(wheel).extractall(site)
    probe = "import specgen.config.compose as c; print(c.conf_dir()); print(c.to_container(c.compose(['target=tiny']))['target']['name'])"
    env = {**os.environ, "PYTHONPATH": str(site)}
    out = subprocess.run([sys.executable, "-c", probe], check=True, capture_output=True, text=True, env=env,
                         cwd=tmp_path, timeout=120).stdout.split()
    assert Path(out[0]) == site / "specgen" / "conf"
    assert out[1] == "tiny"
