"""The JSONL mode's files under stress: a full disk, rows that are not UTF-8, a file read as it runs
(specgen.cli.jsonl, jsonl_input, jsonl_output)."""

from __future__ import annotations

import errno
import io
import json

import pytest

import specgen.batch
import specgen.cli.jsonl
import specgen.cli.jsonl_input
import specgen.cli.jsonl_output
from specgen.cli import main as cli
from specgen.config.compose import compose, exits_on_error, to_container
from specgen.errors import OutputError
from specgen.outputs import OUTPUT_FAILED

from test_jsonl_cli import ARGS, read_records, run_file, write_rows


class FillingFile:
    """A file that takes ``room`` more bytes, then fails like a full disk (a short write, then ENOSPC)."""

    def __init__(self, file, room: int):
        self._file, self.room = file, room

    def write(self, data) -> int:
        if self.room <= 0:
            raise OSError(errno.ENOSPC, "No space left on device")
        data = bytes(data)[: self.room]
        self.room -= len(data)
        return self._file.write(data)

    def __getattr__(self, name):
        return getattr(self._file, name)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self._file.close()


def _fill_output_after(monkeypatch, room: int) -> None:
    real = specgen.cli.jsonl_output.RecordWriter.__init__

    def init(self, file, done=()):
        real(self, FillingFile(file, room), done)

    monkeypatch.setattr(specgen.cli.jsonl_output.RecordWriter, "__init__", init)


def _cli_status(tmp_path, *extra):
    """(status, stderr) of cli.run as the command runs it (exits_on_error), on tmp_path's rows."""
    cfg = to_container(compose([*ARGS, f"prompt_file={tmp_path / 'rows.jsonl'}", f"output={tmp_path / 'out.jsonl'}",
                                *extra]))
    err = io.StringIO()
    try:
        with exits_on_error("specgen"):
            cli.run(cfg, out=io.StringIO(), err=err)
    except SystemExit as exc:
        return exc.code, err.getvalue()
    return 0, err.getvalue()


def test_a_full_disk_keeps_every_whole_record_and_resumes(tmp_path, monkeypatch, capsys):
    """The disk fills in the middle of row 2's record: one line naming the file and ENOSPC, status 74
    (was a Hydra traceback and status 1), rows 0 and 1 whole on disk, no torn line; resume completes."""
    write_rows(tmp_path / "rows.jsonl")
    code, reference, _ = run_file(tmp_path, name="reference.jsonl")
    lines = (tmp_path / "reference.jsonl").read_bytes().splitlines(keepends=True)
    _fill_output_after(monkeypatch, len(lines[0]) + len(lines[1]) + 10)
    code, err = _cli_status(tmp_path)
    message = capsys.readouterr().err
    assert code == OUTPUT_FAILED and "Traceback" not in message and len(message.splitlines()) == 1, message
    assert message.startswith(f"specgen: error: cannot write {tmp_path / 'out.jsonl'}: No space left on device "
                              "(ENOSPC); 2 of 7 rows are in it, each whole"), message
    on_disk = (tmp_path / "out.jsonl").read_bytes()
    assert on_disk.count(b"\n") == 2 and on_disk.endswith(b"\n")  # two whole lines, no torn third
    assert [r["text"] for r in read_records(tmp_path / "out.jsonl")] == [r["text"] for r in reference[:2]]
    monkeypatch.undo()
    code, records, err = run_file(tmp_path, "resume=true")
    assert code == 1 and "(2 resumed)" in err
    assert [r.get("text", r.get("error")) for r in records] == [r.get("text", r.get("error")) for r in reference]


def test_a_full_disk_during_the_resume_rewrite_leaves_the_file_whole(tmp_path, monkeypatch, capsys):
    """The rewrite that puts a resumed file in order fails: the old file unchanged, no temporary
    file left (was a traceback in sort_records, status 1 and a leftover .out.jsonl.sorting)."""
    write_rows(tmp_path / "rows.jsonl")
    _, reference, _ = run_file(tmp_path, name="reference.jsonl")
    lines = (tmp_path / "reference.jsonl").read_bytes().splitlines(keepends=True)
    (tmp_path / "out.jsonl").write_bytes(lines[0] + lines[4])  # a gap: the end of the run rewrites the file
    real_open = open

    def filling_open(path, mode="r", *args, **kwargs):
        file = real_open(path, mode, *args, **kwargs)
        return FillingFile(file, 100) if str(path).endswith(".jsonl.tmp") else file

    monkeypatch.setattr(specgen.cli.jsonl_output, "open", filling_open, raising=False)
    code, _ = _cli_status(tmp_path, "resume=true")
    message = capsys.readouterr().err
    assert code == OUTPUT_FAILED and len(message.splitlines()) == 1 and "(ENOSPC)" in message, message
    assert "the file is unchanged and every record in it is kept" in message
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out.jsonl", "reference.jsonl", "rows.jsonl"]
    on_disk = read_records(tmp_path / "out.jsonl")
    assert sorted(r["index"] for r in on_disk) == list(range(7)) and on_disk[:2] == [reference[0], reference[4]]
    monkeypatch.undo()
    code, records, _ = run_file(tmp_path, "resume=true")
    assert code == 1 and [r["index"] for r in records] == list(range(7))  # the next resume puts it in order


def test_a_row_that_is_not_utf8_is_its_own_error_record(tmp_path):
    """One Latin-1 row among 33: an error record naming its line; the 32 others run (the whole file
    was refused before, after the model loaded)."""
    rows = [json.dumps(f"row {i}").encode() for i in range(33)]
    rows[17] = b'{"prompt": "caf\xe9"}'
    (tmp_path / "rows.jsonl").write_bytes(b"\n".join(rows) + b"\n")
    code, records, err = run_file(tmp_path, "max_new_tokens=2")
    assert code == 1 and "33 rows: 32 ok, 1 errors" in err
    assert records[17]["error"] == "line 18: the row is not UTF-8 text (byte 0xe9 at offset 15)"
    assert all("text" in r for i, r in enumerate(records) if i != 17)


@pytest.mark.parametrize("batch_size", [1, 2])
def test_rows_are_read_as_they_run(tmp_path, monkeypatch, batch_size):
    """When a row runs, the reader has parsed only the rows up to it (one at a time), or up to its
    window (batched): memory follows the rows in flight, not the file."""
    (tmp_path / "rows.jsonl").write_text("".join(json.dumps(f"row {i}") + "\n" for i in range(80)))
    parsed, at_run = [], {}
    real_parse, real_record = specgen.cli.jsonl_input.parse_row, specgen.cli.jsonl.generate_record

    def parse(*args, **kwargs):
        parsed.append(args[1])
        return real_parse(*args, **kwargs)

    def record(pipe, row):
        at_run[row.index] = len(parsed)
        return real_record(pipe, row)

    monkeypatch.setattr(specgen.cli.jsonl_input, "parse_row", parse)
    monkeypatch.setattr(specgen.cli.jsonl, "generate_record", record)
    if batch_size > 1:  # batched rows finish through stream_batch: count the parsed rows at each admission
        real_prepare = specgen.batch.prepare

        def prepare(pipe, prompt, common, index, **kwargs):
            at_run[len(at_run)] = len(parsed)
            return real_prepare(pipe, prompt, common, index, **kwargs)

        monkeypatch.setattr(specgen.batch, "prepare", prepare)
    code, records, _ = run_file(tmp_path, "max_new_tokens=1", f"batch_size={batch_size}")
    assert code == 0 and len(records) == 80 and parsed == list(range(80))
    window = 1 if batch_size == 1 else specgen.cli.jsonl.WINDOW_PER_BATCH_ROW * batch_size
    assert at_run and all(seen <= (index // window + 1) * window for index, seen in at_run.items()), at_run
    assert max(at_run.values()) == 80 and min(at_run.values()) < 80  # negative control: reading went on as rows ran
