"""The ``specgen`` command: a thin Hydra entry point over :mod:`specgen.engine.assemble`.

stdout gets only the generated text, streamed token by token; the summary line
(guarantee, tokens/s, tokens per target call, acceptance by draft position) and
every error go to stderr. Errors a user can cause exit with status 2 and one
line, before the model loads where no model is needed to find them; Ctrl-C stops the
stream cleanly (status 130). A stdout that cannot be written (on /dev/full, closed)
exits with status 74 and one line; a closed pipe (``| head``) quietly with status 141
(:mod:`specgen.outputs`).

With ``output=out.jsonl`` the command runs every row of ``prompt_file=PATH.jsonl``
instead (see :mod:`specgen.cli.jsonl`): stdout stays empty, a progress bar (on a
terminal) and one summary line go to stderr; ``batch_size=N`` runs N rows at a time on
the batched engine (same records, in the same order). Status 0: every row ran; 1: the
output is complete but some rows hold error records; 2: nothing ran (bad config,
unreadable input, an output that already holds results without ``resume=true``);
74: the output could not be written (a full disk), valid up to its last whole record;
130: Ctrl-C, with the output valid up to the last finished row.

``specgen export head=... out=DIR`` writes an eagle3 head for vLLM / SGLang (:mod:`specgen.cli.export`).
"""

from __future__ import annotations

import sys
from collections.abc import Mapping
from pathlib import Path

import hydra
from omegaconf import DictConfig

from specgen.config.checks import JSONL_SUFFIXES
from specgen.config.compose import conf_dir, exits_on_error, run_console, to_container
from specgen.config.run import RunConfig
from specgen.errors import ConfigError, PromptError, not_utf8
from specgen.events import FinishEvent, Generation
from specgen.cli.jsonl import Summary
from specgen.config.options import MAX_CONTEXT_TOKENS, check_prompt, check_prompt_size, prompt_size_bound, size_error
from specgen.outputs import TolerantStream, require_stdout, write_stdout

_COLOURS = {"accepted": "\033[32m", "resampled": "\033[33m", "bonus": "\033[36m", "plain": ""}
_RESET = "\033[0m"


def _prompt_source(cfg: RunConfig | Mapping) -> tuple[str | None, str | None]:
    """(prompt, prompt_file) of a run config, or of a mapping that names either (unset: None)."""
    if isinstance(cfg, RunConfig):
        return cfg.prompt, cfg.prompt_file
    return cfg.get("prompt"), cfg.get("prompt_file")


def check_prompt_source(cfg: RunConfig | Mapping, stdin=None) -> None:
    """PromptError for a prompt source that cannot give a prompt, found without reading it: both
    ``prompt`` and ``prompt_file``, an empty ``prompt``, a ``prompt_file`` that is missing or not a
    regular file or larger than any context holds (MAX_CONTEXT_TOKENS), ``-`` (stdin) with stdin closed, or
    no source at all (nothing given and stdin a terminal)."""
    stdin = sys.stdin if stdin is None else stdin
    prompt, prompt_file = _prompt_source(cfg)
    if prompt is not None and prompt_file is not None:
        raise PromptError("give prompt= or prompt_file=, not both")
    if prompt == "-" or prompt_file == "-":
        if stdin is None:  # started with stdin closed (<&-): Python has no sys.stdin at all
            raise PromptError(f"{'prompt' if prompt == '-' else 'prompt_file'}=- reads stdin, but stdin is closed; "
                              "pipe the prompt in, or give prompt=\"...\" or prompt_file=PATH")
        return
    if prompt_file == "":
        raise PromptError("prompt_file is empty; give the path of a text file (or - for stdin)")
    if prompt_file is not None:
        path = Path(prompt_file)
        if path.is_dir():
            raise PromptError(f"prompt_file {prompt_file} is a directory; give the path of a text file")
        if not path.exists():
            raise PromptError(f"prompt_file {prompt_file} does not exist")
        if not path.is_file():
            raise PromptError(f"prompt_file {prompt_file} is not a regular file; pipe it to stdin (prompt=-) instead")
        size, bound = path.stat().st_size, prompt_size_bound(MAX_CONTEXT_TOKENS)
        if size > bound:  # no model's context holds it: refused before anything loads
            raise PromptError(f"prompt_file {prompt_file} is {size:,} bytes; a prompt for any model's context (at "
                              f"most {MAX_CONTEXT_TOKENS:,} tokens) has at most {bound:,} bytes; shorten it")
    elif prompt is not None:
        check_prompt(prompt)
    elif stdin is None or stdin.isatty():
        raise PromptError('no prompt: use prompt="...", prompt_file=PATH, or pipe text on stdin')


def check_single_prompt(cfg: RunConfig) -> None:
    """ConfigError for settings of the JSONL mode given without ``output=``: a ``.jsonl`` prompt_file
    (one prompt per row), ``batch_size`` above 1 (rows run together)."""
    prompt_file, batch_size = cfg.prompt_file, cfg.batch_size
    if prompt_file and Path(prompt_file).suffix.lower() in JSONL_SUFFIXES:
        raise ConfigError(f"prompt_file {prompt_file} is a JSONL file: add output=PATH.jsonl for one result per row "
                          f"(to send the whole file as one prompt, pipe it: prompt=- < {prompt_file})")
    if batch_size > 1:
        raise ConfigError(f"batch_size={batch_size} runs the rows of a JSONL prompt_file together; "
                          "add output=PATH.jsonl (a single prompt runs alone)")


def read_prompt(cfg: RunConfig | Mapping, stdin=None, *, context_length: int | None = None) -> str:
    """The prompt from ``prompt``, ``prompt_file`` or stdin (``prompt=-`` or piped input).

    PromptError for what :func:`check_prompt_source` refuses, text that is not UTF-8 or is empty
    (or only whitespace), and, given the model's ``context_length``, a prompt more than
    :func:`~specgen.config.options.prompt_size_bound` bytes long: a file is refused by its size before it
    is read, stdin after reading at most one byte past the bound.
    """
    stdin = sys.stdin if stdin is None else stdin
    check_prompt_source(cfg, stdin)
    prompt, prompt_file = _prompt_source(cfg)
    limit = None if context_length is None else prompt_size_bound(context_length)
    if prompt == "-" or prompt_file == "-" or (prompt is None and prompt_file is None):
        text, name = _read_text(stdin, "stdin", limit, context_length), "stdin"
    elif prompt_file is not None:
        text, name = _read_file(Path(prompt_file), limit, context_length), f"prompt_file {prompt_file}"
    else:
        text, name = str(prompt), "prompt"
        if context_length is not None:
            check_prompt_size(text, context_length)
    return check_prompt(text, name)


def _reads_stdin(cfg: RunConfig) -> bool:
    prompt, prompt_file = cfg.prompt, cfg.prompt_file
    return prompt == "-" or prompt_file == "-" or (prompt is None and prompt_file is None)


class _Peeked:
    """A stream whose first bytes (or characters) were read ahead: ``read`` gives them first."""

    def __init__(self, head, rest):
        self._head, self._rest = head, rest

    def read(self, size: int = -1):
        if size is None or size < 0:
            head, self._head = self._head, self._head[:0]
            return head + self._rest.read()
        head, self._head = self._head[:size], self._head[size:]
        return head + self._rest.read(size - len(head)) if len(head) < size else head


class _PeekedStdin:
    """stdin with its first non-blank piece read ahead (:func:`peek_stdin`)."""

    def __init__(self, stdin, head):
        raw = getattr(stdin, "buffer", None)
        self.buffer = _Peeked(head, raw) if raw is not None else None
        self._text = None if raw is not None else _Peeked(head, stdin)
        self._stdin = stdin

    def read(self, size: int = -1):
        return self._text.read(size)

    def isatty(self) -> bool:
        return self._stdin.isatty()


def peek_stdin(stdin, piece: int = 1 << 16):
    """``stdin`` read ahead to its first non-whitespace piece (a pipe's first write, at most ``piece``
    bytes at a time), so an empty or blank stdin is refused (PromptError) before the model loads;
    returns a stream that gives what was read first. Stops at :data:`MAX_CONTEXT_TOKENS`' bound."""
    raw = getattr(stdin, "buffer", None)
    source = raw if raw is not None else stdin
    read = getattr(source, "read1", None) or source.read
    head = source.read(0)
    while len(head) <= prompt_size_bound(MAX_CONTEXT_TOKENS):
        more = read(piece)
        head += more
        if not more or more.strip():
            break
    if not head.strip():
        check_prompt("", "stdin")
    return _PeekedStdin(stdin, head)


def _read_file(path: Path, limit: int | None, context_length: int | None) -> str:
    """The UTF-8 text of ``path``; refused by its size (over ``limit`` bytes) before it is read, and
    read to one byte past ``limit`` at most (a file that reports no size, as in /proc, too)."""
    try:
        size = path.stat().st_size
        if limit is not None and size > limit:
            raise size_error(f"prompt_file {path}", size, "bytes", context_length)
        with open(path, "rb") as file:
            data = file.read() if limit is None else file.read(limit + 1)
        if limit is not None and len(data) > limit:
            raise size_error(f"prompt_file {path}", len(data), "bytes or more", context_length)
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise PromptError(not_utf8(f"prompt_file {path}", exc)) from None
    except OSError as exc:
        raise PromptError(f"cannot read prompt_file {path}: {exc.strerror or exc}") from None


def _read_text(stream, name: str, limit: int | None = None, context_length: int | None = None) -> str:
    """``stream`` as text, at most ``limit`` bytes (PromptError past them, or when it is not UTF-8)."""
    raw = getattr(stream, "buffer", None)
    source = raw if raw is not None else stream
    data = source.read() if limit is None else source.read(limit + 1)
    if limit is not None and len(data) > limit:
        unit = "bytes or more" if raw is not None else "characters or more"
        raise size_error(name, len(data), unit, context_length)
    try:
        return data.decode("utf-8") if raw is not None else data
    except UnicodeDecodeError as exc:
        raise PromptError(not_utf8(name, exc)) from None


def summary_line(gen: Generation) -> str:
    """One line: guarantee, speed, tokens per target call, prompt tokens the prefix cache gave (when it gave
    any), acceptance by draft position, the planner's γ and, under a grammar, its share of wall time and mask
    time per position."""
    s = gen.stats
    parts = [f"[{gen.guarantee.label()}]", f"{s.new_tokens} tokens in {s.wall:.2f} s = {s.tokens_per_s:.1f} tok/s",
             f"tau {s.tokens_per_target_call:.2f} tokens/target call"]
    if s.prefill_reused:
        parts.append(f"prompt {s.prompt_tokens} tokens: {s.prefill_reused} cached, {s.prefill_computed} prefilled")
    if s.drafted:
        per_position = " ".join(f"{a:.2f}" for a in s.acceptance_per_position)
        parts.append(f"acceptance by draft position: {per_position}")
    if s.planner_summary:
        parts.append(s.planner_summary)
    if s.grammar_summary:
        parts.append(s.grammar_summary)
    parts.append(f"finish: {gen.finish_reason}")
    return " | ".join(parts)


def _use_colour(setting, stream) -> bool:
    if setting in (True, "true"):
        return True
    if setting in (False, "false"):
        return False
    return hasattr(stream, "isatty") and stream.isatty()


def run(cfg: Mapping, out=None, err=None) -> Generation | Summary | None:
    """Check the resolved config's values into the run's one :class:`RunConfig`, build the pipeline
    and stream one generation (or, with ``output=``, run the JSONL file: :func:`run_jsonl`)."""
    out = sys.stdout if out is None else out
    err = TolerantStream(sys.stderr if err is None else err)
    cfg = RunConfig.from_cfg(cfg)
    if cfg.output is not None:
        return run_jsonl(cfg, err)
    check_single_prompt(cfg)
    check_prompt_source(cfg)
    require_stdout(out)
    stdin = peek_stdin(sys.stdin) if _reads_stdin(cfg) else None
    from specgen.engine.assemble import build_pipeline  # after the checks: it imports the models

    pipe = build_pipeline(cfg)
    prompt = read_prompt(cfg, stdin, context_length=pipe.target.context_length)
    ui = cfg.ui
    colour = _use_colour(ui["color"], out)
    stream = pipe.stream(prompt)
    generation = None
    try:
        for event in stream:
            if isinstance(event, FinishEvent):
                generation = event.generation
            if ui["stream"] or isinstance(event, FinishEvent):
                start = _COLOURS.get(event.kind, "") if colour else ""
                write_stdout(out, f"{start}{event.text}{_RESET if start else ''}")
    except KeyboardInterrupt:
        stream.close()
        write_stdout(out, "\n")
        err.write("specgen: cancelled\n")
        raise SystemExit(130) from None
    finally:
        stream.close()  # a failed write (StdoutClosed, OutputError) ends the generation too
    write_stdout(out, "\n")
    if ui["summary"] and generation is not None:
        err.write(summary_line(generation) + "\n")
    return generation


def run_jsonl(cfg: RunConfig, err) -> Summary:
    """Run every row of ``prompt_file`` into ``output`` (a checked config); raises SystemExit(1)
    when some rows hold error records and SystemExit(130) on Ctrl-C, after the summary line."""
    from tqdm import tqdm

    from specgen.engine.assemble import build_pipeline
    from specgen.cli.jsonl import job_from_config
    from specgen.cli.jsonl_input import check_has_rows

    check_has_rows(Path(cfg.prompt_file))  # before the model loads
    pipe = build_pipeline(cfg)
    job = job_from_config(cfg, pipe.target.context_length)
    show = hasattr(err, "isatty") and err.isatty()
    bar = tqdm(total=job.summary.rows, initial=job.summary.finished, unit="row", file=err, disable=not show)
    try:
        summary = job.run(pipe, on_row=bar.update, batch_size=cfg.batch_size)
    except KeyboardInterrupt:
        bar.close()
        s = job.summary
        err.write(f"specgen: cancelled; {s.finished} of {s.rows} rows are in {s.output} (resume=true continues)\n")
        raise SystemExit(130) from None
    finally:
        bar.close()  # before an error line (a full disk), too
    if cfg.ui["summary"]:
        err.write(summary.line() + "\n")
    if summary.errors:
        raise SystemExit(1)
    return summary


@hydra.main(config_path=str(conf_dir()), config_name="config", version_base=None)
def _hydra_main(cfg: DictConfig) -> None:
    with exits_on_error("specgen"):
        run(to_container(cfg))


def main() -> None:
    """Console entry point: check the overrides (one line, status 2), quote free text, hand over to Hydra.

    ``specgen export ...`` (first argument) writes a head for vLLM/SGLang instead: :mod:`specgen.cli.export`."""
    if sys.argv[1:2] == ["export"]:
        from specgen.cli.export import main as export_main
        from specgen.outputs import tolerate_stderr

        tolerate_stderr()
        export_main(sys.argv[2:])
        return
    run_console(_hydra_main, "specgen", "config")
