"""The ``specgen`` command: a thin Hydra entry point over :mod:`specgen.build`.

stdout gets only the generated text, streamed token by token; the summary line
(guarantee, tokens/s, tokens per target call, acceptance by draft position) and
every error go to stderr. Errors a user can cause exit with status 2 and one
line; Ctrl-C stops the stream cleanly (status 130).
"""

from __future__ import annotations

import sys
from pathlib import Path

import hydra
from omegaconf import DictConfig

from specgen.config import conf_dir, prepare_overrides, to_container
from specgen.errors import PromptError, SpecgenError
from specgen.events import FinishEvent, Generation

_COLOURS = {"accepted": "\033[32m", "resampled": "\033[33m", "bonus": "\033[36m", "plain": ""}
_RESET = "\033[0m"


def read_prompt(cfg: dict, stdin=None) -> str:
    """The prompt from ``prompt``, ``prompt_file`` or stdin (``prompt=-`` or piped input)."""
    stdin = sys.stdin if stdin is None else stdin
    prompt, prompt_file = cfg.get("prompt"), cfg.get("prompt_file")
    if prompt is not None and prompt_file is not None:
        raise PromptError("give prompt= or prompt_file=, not both")
    if prompt == "-" or prompt_file == "-":
        return stdin.read()
    if prompt_file is not None:
        path = Path(prompt_file)
        if not path.is_file():
            raise PromptError(f"prompt_file {prompt_file} does not exist")
        return path.read_text(encoding="utf-8")
    if prompt is not None:
        return str(prompt)
    if stdin is not None and not stdin.isatty():
        return stdin.read()
    raise PromptError('no prompt: use prompt="...", prompt_file=PATH, or pipe text on stdin')


def summary_line(gen: Generation) -> str:
    """One line: guarantee, speed, tokens per target call, acceptance by draft position."""
    s = gen.stats
    parts = [f"[{gen.guarantee}]", f"{s.new_tokens} tokens in {s.wall:.2f} s = {s.tokens_per_s:.1f} tok/s",
             f"tau {s.tokens_per_target_call:.2f} tokens/target call"]
    if s.drafted:
        per_position = " ".join(f"{a:.2f}" for a in s.acceptance_per_position)
        parts.append(f"acceptance by draft position: {per_position}")
    parts.append(f"finish: {gen.finish_reason}")
    return " | ".join(parts)


def _use_colour(setting, stream) -> bool:
    if setting in (True, "true"):
        return True
    if setting in (False, "false"):
        return False
    return hasattr(stream, "isatty") and stream.isatty()


def run(cfg: dict, out=None, err=None) -> Generation | None:
    """Build the pipeline from a resolved config and stream one generation."""
    from specgen.build import build_pipeline

    out = sys.stdout if out is None else out
    err = sys.stderr if err is None else err
    prompt = read_prompt(cfg)
    pipe = build_pipeline(cfg)
    ui = cfg.get("ui") or {}
    colour = _use_colour(ui.get("color", "auto"), out)
    stream = pipe.stream(prompt)
    generation = None
    try:
        for event in stream:
            if isinstance(event, FinishEvent):
                generation = event.generation
            if ui.get("stream", True) or isinstance(event, FinishEvent):
                start = _COLOURS.get(event.kind, "") if colour else ""
                out.write(f"{start}{event.text}{_RESET if start else ''}")
                out.flush()
    except KeyboardInterrupt:
        stream.close()
        out.write("\n")
        err.write("specgen: cancelled\n")
        raise SystemExit(130) from None
    out.write("\n")
    if ui.get("summary", True) and generation is not None:
        err.write(summary_line(generation) + "\n")
    return generation


@hydra.main(config_path=str(conf_dir()), config_name="config", version_base=None)
def _hydra_main(cfg: DictConfig) -> None:
    try:
        run(to_container(cfg))
    except SpecgenError as exc:
        sys.stderr.write(f"specgen: error: {exc}\n")
        raise SystemExit(2) from None


def main() -> None:
    """Console entry point: quote free-text overrides, then hand over to Hydra."""
    sys.argv = [sys.argv[0], *prepare_overrides(sys.argv[1:])]
    _hydra_main()
