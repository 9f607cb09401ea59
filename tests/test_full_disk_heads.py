"""A full disk under specgen-train's train.out and specgen export (train.cli, heads.store, heads.export):
nothing trained is lost, nothing partial is left, one line says where things are."""

from __future__ import annotations

import errno
import io

import pytest

import specgen.heads.export
import specgen.heads.store
import specgen.train.cli
from specgen.errors import OutputError
from specgen.heads.store import read_metadata
from specgen.train.cli import compose_train, run_train

from test_eagle3_export import _export, _head, _target
from test_train import TINY


@pytest.fixture(autouse=True)
def _cache(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECGEN_CACHE", str(tmp_path / "cache"))


def _full_under(folder, real):
    """``real`` (a safetensors save_file), failing like a full disk for files in ``folder`` after a
    partial write."""
    def save_file(tensors, filename, metadata=None):
        if str(filename).startswith(str(folder)):
            with open(filename, "wb") as file:
                file.write(b"partial")
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(tensors, filename, metadata=metadata)
    return save_file


def test_a_full_train_out_keeps_the_trained_head_elsewhere(tmp_path, monkeypatch):
    """train.out's disk fills when the head is saved: the head goes to the temporary directory, one
    OutputError line names both places, no partial file is left (the head was lost before)."""
    out_dir, rescue = tmp_path / "heads", tmp_path / "rescue"
    out_dir.mkdir()
    rescue.mkdir()
    monkeypatch.setattr(specgen.heads.store, "save_file", _full_under(out_dir, specgen.heads.store.save_file))
    monkeypatch.setattr(specgen.train.cli.tempfile, "gettempdir", lambda: str(rescue))
    cfg = compose_train([*TINY, "train.kind=medusa", "train.steps=3", f"train.out={out_dir / 'm.safetensors'}"])
    with pytest.raises(OutputError) as info:
        run_train(cfg, command="test", out=io.StringIO())
    message = str(info.value)
    kept = next(rescue.iterdir())
    assert "\n" not in message and message.startswith(f"cannot write {out_dir / 'm.safetensors'}: No space left")
    assert "(ENOSPC)" in message and f"the trained head is kept in {kept}: move it to" in message
    assert read_metadata(kept)["specgen.kind"] == "medusa"
    assert sorted(p.name for p in out_dir.iterdir()) == []  # no .tmp, no partial head, checkpoint dropped


def test_too_little_room_for_train_out_is_refused_before_training(tmp_path, monkeypatch):
    import collections

    trained = []
    monkeypatch.setattr(specgen.train.cli.shutil, "disk_usage",
                        lambda path: collections.namedtuple("Usage", "total used free")(1, 1, 4096))
    monkeypatch.setattr("specgen.train.loop.train_head", lambda *a, **k: trained.append(1))
    cfg = compose_train([*TINY, "train.kind=medusa", "train.steps=3", f"train.out={tmp_path / 'm.safetensors'}"])
    with pytest.raises(OutputError, match=r"its disk has 0\.0 MiB free; the head and its checkpoints need about"):
        run_train(cfg, command="test", out=io.StringIO())
    assert not trained and not (tmp_path / "m.safetensors").exists()


def test_a_full_disk_during_export_leaves_no_partial_file(tmp_path, monkeypatch):
    target = _target()
    out = tmp_path / "draft"
    monkeypatch.setattr(specgen.heads.export, "save_file", _full_under(out, specgen.heads.export.save_file))
    with pytest.raises(OutputError, match=r"cannot write .*model\.safetensors: No space left on device \(ENOSPC\); "
                                          "no partial file is left"):
        _export(_head(target), target, out)
    assert list(out.iterdir()) == []
    monkeypatch.undo()
    assert (_export(_head(target), target, out) / "config.json").is_file()  # negative control: room again
