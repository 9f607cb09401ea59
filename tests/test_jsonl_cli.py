"""JSONL in, JSONL out: ``specgen prompt_file=rows.jsonl output=out.jsonl`` (specgen.cli.jsonl, cli.run_jsonl)."""

from __future__ import annotations

import io
import json

import pytest

from specgen.cli import main as cli
from specgen.config.checks import check_run_config
from specgen.config.compose import compose, to_container
from specgen.errors import ConfigError
from specgen.cli.jsonl import RecordWriter

from conftest import TINY, tiny_pipeline

ARGS = (*TINY, "drafter=tiny", "max_new_tokens=6")
ROWS = [
    "Hello there",
    {"prompt": "count to three", "id": "b", "max_new_tokens": 4},
    {"prompt": "pick a letter", "id": 7, "regex": "[a-e]+", "seed": 3},
    {"prompt": "x", "id": "refused", "schema": {"not": {"type": "string"}}},
    {"promt": "a typo in the key", "id": "typo"},
    "THIS LINE IS NOT JSON",
    {"prompt": "stop early", "stop": ["e"], "speculative": False},
]
OK_INDICES = [0, 1, 2, 6]


def write_rows(path, rows=ROWS) -> None:
    lines = [row if row == "THIS LINE IS NOT JSON" else json.dumps(row) for row in rows]
    path.write_text("\n".join(lines[:3]) + "\n\n" + "\n".join(lines[3:]) + "\n", encoding="utf-8")


def read_records(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]


def run_file(tmp_path, *extra, name="out.jsonl"):
    """cli.run in-process; returns (exit status, records, stderr)."""
    rows = tmp_path / "rows.jsonl"
    if not rows.exists():
        write_rows(rows)
    cfg = to_container(compose([*ARGS, f"prompt_file={rows}", f"output={tmp_path / name}", *extra]))
    err = io.StringIO()
    try:
        cli.run(cfg, out=io.StringIO(), err=err)
        code = 0
    except SystemExit as exc:
        code = exc.code
    return code, read_records(tmp_path / name), err.getvalue()


@pytest.fixture(scope="module")
def full_run(tmp_path_factory):
    tmp_path = tmp_path_factory.mktemp("full")
    return tmp_path, *run_file(tmp_path)


def test_rows_in_order_with_per_row_errors(full_run):
    _, code, records, err = full_run
    assert code == 1  # complete, but some rows hold error records
    assert err.strip() == "7 rows: 4 ok, 3 errors -> " + str(full_run[0] / "out.jsonl")
    assert [r["index"] for r in records] == list(range(7))
    assert [r["id"] for r in records] == [None, "b", 7, "refused", "typo", None, None]
    assert [i for i, r in enumerate(records) if "error" not in r] == OK_INDICES
    assert "'not'" in records[3]["error"] and records[3]["error"].startswith("line 5: ")  # the blank line counts
    assert records[4]["error"] == "line 6: unknown key 'promt'; did you mean prompt?"
    assert records[5]["error"].startswith("line 7: not valid JSON")
    for record in (records[i] for i in OK_INDICES):
        assert set(record) == {"index", "id", "text", "finish_reason", "guarantee", "stats", "fingerprint"}
        assert record["stats"]["new_tokens"] >= 1 and record["stats"]["target_calls"] >= 1
    assert records[1]["stats"]["new_tokens"] <= 4
    assert records[6]["guarantee"] == "off: speculative=false"


def test_rows_equal_single_requests(full_run):
    """Each ok row is exactly what pipe.generate gives for that request alone (greedy, float32)."""
    _, _, records, _ = full_run
    pipe = tiny_pipeline("max_new_tokens=6")
    expected = [pipe.generate("Hello there"), pipe.generate("count to three", max_new_tokens=4),
                pipe.generate("pick a letter", regex="[a-e]+", seed=3),
                pipe.generate("stop early", stop=["e"], speculative=False)]
    for index, gen in zip(OK_INDICES, expected):
        assert (records[index]["text"], records[index]["finish_reason"]) == (gen.text, gen.finish_reason)
        assert records[index]["guarantee"] == str(gen.guarantee)
        assert records[index]["stats"]["new_tokens"] == gen.stats.new_tokens
    assert set(records[2]["text"]) <= set("abcde")


def test_sampled_rows_do_not_depend_on_position(tmp_path):
    """A row's seed (or the command line's) alone decides its sample: reversing the file changes nothing."""
    rows = [{"prompt": f"row {i}", "id": i, "seed": i % 2} for i in range(3)]
    write_rows(tmp_path / "rows.jsonl", rows)
    _, forward, _ = run_file(tmp_path, "sampling.temperature=0.9", name="a.jsonl")
    write_rows(tmp_path / "rows.jsonl", rows[::-1])
    _, backward, _ = run_file(tmp_path, "sampling.temperature=0.9", name="b.jsonl")
    by_id = {r["id"]: r["text"] for r in backward}
    assert [r["text"] for r in forward] == [by_id[r["id"]] for r in forward]
    sampled = tiny_pipeline("sampling.temperature=0.9", "max_new_tokens=6").generate("row 1", seed=1)
    assert forward[1]["text"] == sampled.text


def test_existing_output_is_refused_without_resume(tmp_path):
    out = tmp_path / "out.jsonl"
    out.write_text('{"index": 0, "id": null, "text": "earlier"}\n', encoding="utf-8")
    write_rows(tmp_path / "rows.jsonl")
    cfg = to_container(compose([*ARGS, f"prompt_file={tmp_path / 'rows.jsonl'}", f"output={out}"]))
    with pytest.raises(ConfigError, match="already holds results; add resume=true"):
        cli.run(cfg)
    assert out.read_text(encoding="utf-8") == '{"index": 0, "id": null, "text": "earlier"}\n'


def test_resume_skips_finished_rows_and_repairs_a_torn_line(tmp_path, full_run):
    reference = read_records(full_run[0] / "out.jsonl")
    kept = [{**reference[0], "text": "KEPT FROM THE FIRST RUN"}, reference[1]]
    torn = json.dumps(reference[2])[:25]
    lines = "".join(json.dumps(record) + "\n" for record in kept)
    (tmp_path / "out.jsonl").write_text(lines + torn, encoding="utf-8")
    code, records, err = run_file(tmp_path, "resume=true")
    assert code == 1 and err.strip().endswith("(2 resumed)") and "7 rows: 4 ok, 3 errors" in err
    assert records[0]["text"] == "KEPT FROM THE FIRST RUN"  # skipped, not run again
    assert [r["index"] for r in records] == list(range(7))
    assert [r.get("text", r.get("error")) for r in records[1:]] == \
        [r.get("text", r.get("error")) for r in reference[1:]]


@pytest.mark.parametrize("batch_size", ["1", "3"])
def test_resume_over_a_gap_ends_in_input_order(tmp_path, full_run, batch_size):
    """Rows 0, 1 and 4 kept (4 marked): the missing rows run and the file ends as 0, 1, 2, ..., 6."""
    reference = read_records(full_run[0] / "out.jsonl")
    kept = [reference[0], reference[1], {**reference[4], "error": "KEPT FROM THE FIRST RUN"}]
    (tmp_path / "out.jsonl").write_text("".join(json.dumps(r) + "\n" for r in kept), encoding="utf-8")
    code, records, err = run_file(tmp_path, "resume=true", f"batch_size={batch_size}")
    assert code == 1 and err.strip().endswith("(3 resumed)")
    assert [r["index"] for r in records] == list(range(7))
    assert records[4]["error"] == "KEPT FROM THE FIRST RUN"
    assert [r.get("text") for r in records] == [r.get("text") for r in reference]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out.jsonl", "rows.jsonl"]


def test_an_interrupted_resume_over_a_gap_keeps_every_record_in_order(tmp_path, monkeypatch, full_run):
    import specgen.cli.jsonl

    reference = read_records(full_run[0] / "out.jsonl")
    (tmp_path / "out.jsonl").write_text("".join(json.dumps(reference[i]) + "\n" for i in (0, 5)), encoding="utf-8")
    real_record = specgen.cli.jsonl.generate_record

    def interrupted_at_row_3(pipe, row):
        if row.index == 3:
            raise KeyboardInterrupt
        return real_record(pipe, row)

    monkeypatch.setattr(specgen.cli.jsonl, "generate_record", interrupted_at_row_3)
    code, records, _ = run_file(tmp_path, "resume=true")
    assert code == 130 and [r["index"] for r in records] == [0, 1, 2, 5]


def test_a_byte_order_mark_and_a_row_nested_too_deeply(tmp_path):
    """A UTF-8 BOM (Windows editors) is not part of the first row; a row nesting JSON too deeply is
    an error row, not a crash."""
    rows = tmp_path / "rows.jsonl"
    rows.write_bytes(b'\xef\xbb\xbf"first"\n' + b"[" * 100_000 + b"]" * 100_000 + b'\n"last"\n')
    code, records, err = run_file(tmp_path)
    assert code == 1 and "3 rows: 2 ok, 1 errors" in err
    assert "text" in records[0] and "text" in records[2]
    assert records[1]["error"] == "line 2: the row nests JSON arrays or objects too deeply to parse"


def test_a_lone_surrogate_is_an_error_row_not_a_crash(tmp_path):
    """A JSON escape \\ud800 with no pair decodes to a string no tokenizer can encode (a real one raised
    TypeError mid-file and sank every later row): an error row, and the rows after it run."""
    rows = tmp_path / "rows.jsonl"
    rows.write_text('"first"\n{"prompt": "bad \\ud800"}\n{"prompt": "ok", "system": "\\udcff"}\n"last"\n',
                    encoding="utf-8")
    code, records, err = run_file(tmp_path)
    assert code == 1 and "4 rows: 2 ok, 2 errors" in err
    assert "text" in records[0] and "text" in records[3]
    assert records[1]["error"] == ("line 2: prompt is not valid Unicode text: a lone surrogate U+D800 at character 4 "
                                   "(from an unpaired \\ud800-style escape, or bytes that are not UTF-8)")
    assert records[2]["error"].startswith("line 3: system is not valid Unicode text: a lone surrogate U+DCFF")


@pytest.mark.parametrize("content", ["not a record\n", '{"index": 0, "id": null, "text": "a"}\nnot a record\n'])
def test_resume_refuses_a_file_whose_last_complete_line_is_not_a_record(tmp_path, content):
    """Only a line without its newline is torn; any other line that is not a record is the user's, kept intact."""
    write_rows(tmp_path / "rows.jsonl")
    out = tmp_path / "out.jsonl"
    out.write_text(content, encoding="utf-8")
    cfg = to_container(compose([*ARGS, f"prompt_file={tmp_path / 'rows.jsonl'}", f"output={out}", "resume=true"]))
    with pytest.raises(ConfigError, match="is not a specgen result record; it cannot be resumed"):
        cli.run(cfg, out=io.StringIO(), err=io.StringIO())
    assert out.read_text(encoding="utf-8") == content


def test_resume_reruns_the_rows_of_another_input_or_other_settings(tmp_path, full_run):
    """An output written from another input: rows whose line changed (same id) are rerun, the others
    kept; other generation settings rerun every row. Before fingerprints only index and id were
    compared, and row 1's old answer was kept for a new prompt."""
    reference = read_records(full_run[0] / "out.jsonl")
    changed = list(ROWS)
    changed[1] = {**ROWS[1], "prompt": "count to four"}
    changed[6] = {**ROWS[6], "prompt": "stop later"}
    write_rows(tmp_path / "rows.jsonl", changed)
    marked = [{**r, "text": "KEPT"} if "text" in r else r for r in reference]
    (tmp_path / "out.jsonl").write_text("".join(json.dumps(r) + "\n" for r in marked), encoding="utf-8")
    code, records, err = run_file(tmp_path, "resume=true")
    assert code == 1 and err.strip().endswith("(5 resumed, 2 rerun: their row or settings changed)"), err
    assert [r["index"] for r in records] == list(range(7))  # the old records of rows 1 and 6 are gone
    assert [r.get("text") for r in records] == ["KEPT", records[1]["text"], "KEPT", None, None, None,
                                                records[6]["text"]]
    fresh = tiny_pipeline("max_new_tokens=6")
    assert records[1]["text"] == fresh.generate("count to four", max_new_tokens=4).text != "KEPT"
    assert records[6]["text"] == fresh.generate("stop later", stop=["e"], speculative=False).text
    code, records, err = run_file(tmp_path, "resume=true", "max_new_tokens=5")
    assert code == 1 and err.strip().endswith("(7 rerun: their row or settings changed)"), err
    assert "KEPT" not in [r.get("text") for r in records] and len(records) == 7


def test_resume_reruns_a_record_without_a_fingerprint(tmp_path):
    (tmp_path / "out.jsonl").write_text('{"index": 0, "id": null, "text": "from an older specgen"}\n',
                                        encoding="utf-8")
    code, records, err = run_file(tmp_path, "resume=true")
    assert code == 1 and "(1 rerun: its row or settings changed)" in err
    assert len(records) == 7 and records[0]["text"] != "from an older specgen"


def test_ctrl_c_after_k_rows_leaves_k_valid_rows(tmp_path, monkeypatch, full_run):
    """KeyboardInterrupt mid-generation of row 2: status 130, rows 0 and 1 on disk, resume completes."""
    import specgen.engine.pipeline
    import specgen.cli.jsonl

    real_record, real_step = specgen.cli.jsonl.generate_record, specgen.engine.pipeline.plain_step
    state = {"row": None, "steps": 0}

    def tracking(pipe, row):
        state["row"], state["steps"] = row.index, 0
        return real_record(pipe, row)

    def interrupting(*args, **kwargs):
        state["steps"] += 1
        if state["row"] == 2 and state["steps"] == 2:
            raise KeyboardInterrupt
        return real_step(*args, **kwargs)

    monkeypatch.setattr(specgen.cli.jsonl, "generate_record", tracking)
    monkeypatch.setattr(specgen.engine.pipeline, "plain_step", interrupting)
    code, records, err = run_file(tmp_path, "speculative=false")
    assert code == 130
    assert err.strip() == f"specgen: cancelled; 2 of 7 rows are in {tmp_path / 'out.jsonl'} (resume=true continues)"
    assert [r["index"] for r in records] == [0, 1]
    assert (tmp_path / "out.jsonl").read_bytes().endswith(b"\n")
    monkeypatch.setattr(specgen.engine.pipeline, "plain_step", real_step)
    code, records, _ = run_file(tmp_path, "speculative=false", "resume=true")
    reference = read_records(full_run[0] / "out.jsonl")
    assert code == 1 and [r["index"] for r in records] == list(range(7))
    assert [r.get("text") for r in records] == [r.get("text") for r in reference]  # greedy: plain == speculative


def test_writer_keeps_input_order_when_rows_finish_out_of_order(tmp_path):
    """What a batched engine will rely on: records wait until every earlier row is written."""
    path = tmp_path / "out.jsonl"
    with open(path, "ab", buffering=0) as file:
        writer = RecordWriter(file, done={0})
        assert writer.put(3, {"index": 3}) == []
        assert writer.put(1, {"index": 1}) == [{"index": 1}]
        assert writer.put(2, {"index": 2}) == [{"index": 2}, {"index": 3}]
    assert [r["index"] for r in read_records(path)] == [1, 2, 3]


def test_batched_rows_equal_sequential_rows(tmp_path, full_run):
    """batch_size=3: the same file (greedy texts, stats counts, error records in the middle of a
    batch, with the same messages), though rows finish out of order."""
    code, records, err = run_file(tmp_path, "batch_size=3")
    reference = read_records(full_run[0] / "out.jsonl")
    assert code == 1 and err.strip() == "7 rows: 4 ok, 3 errors -> " + str(tmp_path / "out.jsonl")
    assert [r["index"] for r in records] == list(range(7))
    for got, want in zip(records, reference):
        assert {k: v for k, v in got.items() if k != "stats"} == {k: v for k, v in want.items() if k != "stats"}
        if "stats" in want:
            assert got["stats"]["new_tokens"] == want["stats"]["new_tokens"]
    assert records[1]["stats"]["new_tokens"] < records[0]["stats"]["new_tokens"]  # ragged: rows end apart


def test_batched_resume_runs_only_the_missing_rows(tmp_path, full_run):
    reference = read_records(full_run[0] / "out.jsonl")
    kept = [{**reference[0], "text": "KEPT FROM THE FIRST RUN"}, *reference[1:4]]
    lines = "".join(json.dumps(record) + "\n" for record in kept)
    (tmp_path / "out.jsonl").write_text(lines + json.dumps(reference[4])[:10], encoding="utf-8")
    code, records, err = run_file(tmp_path, "resume=true", "batch_size=4")
    assert code == 1 and err.strip().endswith("(4 resumed)") and "7 rows: 4 ok, 3 errors" in err
    assert records[0]["text"] == "KEPT FROM THE FIRST RUN"
    assert [r.get("text", r.get("error")) for r in records[1:]] == \
        [r.get("text", r.get("error")) for r in reference[1:]]


def test_ctrl_c_mid_batch_leaves_valid_jsonl(tmp_path, monkeypatch, full_run):
    """KeyboardInterrupt in the first batched step after rows 0 and 1 finished (rows 2 and 6 are
    mid-generation, error rows 3-5 wait for row 2): rows 0 and 1 on disk, whole lines; resume completes."""
    import specgen.batch.steps

    real_step = specgen.batch.steps.step
    finished: set[int] = set()

    def interrupting(kv, live, *rest):
        if finished >= {0, 1}:
            raise KeyboardInterrupt
        out = real_step(kv, live, *rest)
        finished.update(row.spec.index for _, row in live if row.request.finish_reason is not None)
        return out

    monkeypatch.setattr(specgen.batch.steps, "step", interrupting)
    code, records, err = run_file(tmp_path, "batch_size=2")
    assert code == 130
    assert err.strip() == f"specgen: cancelled; 2 of 7 rows are in {tmp_path / 'out.jsonl'} (resume=true continues)"
    assert [r["index"] for r in records] == [0, 1]
    assert (tmp_path / "out.jsonl").read_bytes().endswith(b"\n")
    monkeypatch.setattr(specgen.batch.steps, "step", real_step)
    code, records, _ = run_file(tmp_path, "batch_size=2", "resume=true")
    reference = read_records(full_run[0] / "out.jsonl")
    assert code == 1 and [r.get("text", r.get("error")) for r in records] == \
        [r.get("text", r.get("error")) for r in reference]


def test_a_failed_batch_step_sends_the_unfinished_rows_one_at_a_time(tmp_path, monkeypatch, full_run):
    """A SpecgenError out of a batched step cannot be pinned on one row: the rows without a record
    run alone on pipe.stream, so each gets its own result (or error) record and the file is complete."""
    import specgen.batch.steps
    import specgen.cli.jsonl
    from specgen.errors import SpecgenError

    real_step, real_record = specgen.batch.steps.step, specgen.cli.jsonl.generate_record
    calls, alone = [], []

    def failing(kv, live, *rest):
        calls.append(len(live))
        if len(calls) == 3:
            raise SpecgenError("a step failed")
        return real_step(kv, live, *rest)

    def tracking(pipe, row):
        alone.append(row.index)
        return real_record(pipe, row)

    monkeypatch.setattr(specgen.batch.steps, "step", failing)
    monkeypatch.setattr(specgen.cli.jsonl, "generate_record", tracking)
    code, records, _ = run_file(tmp_path, "batch_size=4")
    reference = read_records(full_run[0] / "out.jsonl")
    assert code == 1 and [r.get("text", r.get("error")) for r in records] == \
        [r.get("text", r.get("error")) for r in reference]
    assert len(calls) == 3 and alone and set(alone) <= set(OK_INDICES)


@pytest.mark.parametrize("extra, message", [
    (["batch_size=0"], "batch_size must be"),
    (["batch_size=257"], "batch_size must be at most 256, got 257"),
    (["batch_size=abc"], "batch_size must be an integer"),
    (["batch_size=4", "drafter=eagle"], "batch_size=4: tree drafters .* drafter=eagle needs batch_size=1"),
    (["batch_size=2", "drafter=medusa"], "drafter=medusa needs batch_size=1"),
    (["batch_size=2", "compile=true"], "compiled targets are not batched yet"),
])
def test_bad_batch_size_is_one_line_before_loading(tmp_path, extra, message):
    write_rows(tmp_path / "rows.jsonl")
    args = [*TINY, f"prompt_file={tmp_path / 'rows.jsonl'}", f"output={tmp_path / 'o.jsonl'}", *extra]
    with pytest.raises(ConfigError, match=message) as info:
        check_run_config(to_container(compose(args)))
    assert "\n" not in str(info.value)


def test_tree_drafter_batches_with_speculation_off(tmp_path):
    cfg = to_container(compose([*TINY, "drafter=eagle", "batch_size=4", "speculative=false"]))
    assert check_run_config(cfg)["batch_size"] == 4


@pytest.mark.parametrize("extra, message", [
    (["resume=true"], "resume=true continues an output file; add output=PATH.jsonl"),
    (["output={tmp}/o.jsonl", "prompt=hi"], "give that instead of prompt="),
    (["output={tmp}/o.jsonl"], "output= needs prompt_file=PATH.jsonl"),
    (["output={tmp}/o.jsonl", "prompt_file={tmp}/rows.txt"], "must be a .jsonl file"),
    (["output={tmp}/o.jsonl", "prompt_file={tmp}/missing.jsonl"], "missing.jsonl does not exist"),
    (["output={tmp}/rows.jsonl", "prompt_file={tmp}/rows.jsonl"], "is the prompt_file itself"),
    (["output={tmp}", "prompt_file={tmp}/rows.jsonl"], "is a directory; give a file path such as"),
    (["output={tmp}/rows.jsonl/o.jsonl", "prompt_file={tmp}/rows.jsonl"], "cannot be created"),
    (["output={tmp}/nodir/o.jsonl", "prompt_file={tmp}/rows.jsonl"], "nodir does not exist; create it first"),
    (["output=/proc/nope/o.jsonl", "prompt_file={tmp}/rows.jsonl"], "/proc/nope does not exist"),
    (["output=/proc/o.jsonl", "prompt_file={tmp}/rows.jsonl"], "no file can be created in /proc"),
    (["output=/dev/null", "prompt_file={tmp}/rows.jsonl"], "is not a regular file"),
    (["output={tmp}/o.jsonl", "prompt_file={tmp}/rows.jsonl", "resume=maybe"], "resume must be a boolean"),
])
def test_bad_jsonl_settings_are_one_line_before_loading(tmp_path, extra, message):
    write_rows(tmp_path / "rows.jsonl")
    (tmp_path / "rows.txt").write_text("hi\n", encoding="utf-8")
    cfg = to_container(compose([*ARGS, *(arg.format(tmp=tmp_path) for arg in extra)]))
    with pytest.raises(ConfigError, match=message) as info:
        check_run_config(cfg)
    assert "\n" not in str(info.value)
