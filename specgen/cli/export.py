"""``specgen export``: write a trained eagle3 head in the layout vLLM and SGLang load.

    specgen export head=heads/eagle3.safetensors out=heads/eagle3-vllm target=smollm2-135m

``target=`` (and any ``target.*`` override) names the head's target like every
specgen command (default: the config's target); it is loaded once, to cut its
LM-head rows to the draft vocabulary and to check the head's fingerprint.
``dtype=`` is the stored tensors' dtype (bfloat16 | float16 | float32, default
bfloat16); ``num_speculative_tokens=`` goes into the printed serving commands.
stdout gets the serving commands (also written to ``out/README.md``); errors a
user can cause exit with status 2 and one line; Ctrl-C exits 130.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Sequence
from pathlib import Path

from specgen.errors import ConfigError

USAGE = ("specgen export head=HEAD.safetensors out=DIR [target=NAME] [target.KEY=VALUE ...] "
         "[dtype=bfloat16|float16|float32] [num_speculative_tokens=3]")
_OWN_KEYS = ("head", "out", "dtype", "num_speculative_tokens")


def parse_args(args: Sequence[str]) -> tuple[dict[str, str], list[str]]:
    """(own settings, Hydra overrides for the target) from ``key=value`` arguments."""
    settings: dict[str, str] = {}
    overrides: list[str] = []
    for arg in args:
        key, sep, value = arg.partition("=")
        if not sep or not key:
            raise ConfigError(f"export takes key=value arguments, got {arg!r}; usage: {USAGE}")
        if key in _OWN_KEYS:
            settings[key] = value
        elif key.lstrip("+~") == "target" or key.lstrip("+~").startswith("target.") or key == "device":
            overrides.append(arg)
        else:
            raise ConfigError(f"export does not take {key}=; usage: {USAGE}")
    missing = [k for k in ("head", "out") if not settings.get(k)]
    if missing:
        raise ConfigError(f"export needs {' and '.join(f'{k}=' for k in missing)}; usage: {USAGE}")
    return settings, overrides


def run_export(args: Sequence[str], out=None) -> Path:
    """Check the arguments, load the target and the head, write the export; returns its directory."""
    import torch

    from specgen.config.compose import compose, to_container
    from specgen.config.options import MAX_NUM_TOKENS
    from specgen.heads.export import check_export_dir, export_eagle3
    from specgen.heads.store import load_head
    from specgen.models import load_model, resolve_device
    from specgen.outputs import write_stdout

    out = sys.stdout if out is None else out
    settings, overrides = parse_args(args)
    dtypes = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
    dtype = dtypes.get(settings.get("dtype", "bfloat16"))
    if dtype is None:
        raise ConfigError(f"dtype={settings['dtype']} is not one of {', '.join(dtypes)}")
    steps = settings.get("num_speculative_tokens", "3")
    if not (steps.isascii() and steps.isdigit()) or not 1 <= int(steps) <= MAX_NUM_TOKENS:
        raise ConfigError(f"num_speculative_tokens={steps} must be an integer from 1 to {MAX_NUM_TOKENS}")
    head_path = Path(settings["head"])
    if not head_path.is_file():
        raise ConfigError(f"head={head_path} is not a file; give the .safetensors head specgen-train wrote")
    out_dir = check_export_dir(Path(settings["out"]), "out")
    cfg = to_container(compose(overrides))
    target_cfg = cfg["target"]
    loaded = load_model(target_cfg["source"], name="target", dtype=torch.float32,
                        device=resolve_device(str(cfg["device"])), progress=False)
    model = loaded.lm.hf_model.eval().requires_grad_(False)
    head, meta = load_head(head_path, model, kind="eagle3")
    source = target_cfg["source"]
    name = source.get("repo") or (source.get("path") if source.get("kind") == "dir" else None)
    path = export_eagle3(head, out_dir, target_config=model.config,
                         fingerprint=json.loads(meta.get("specgen.fingerprint", "{}")), dtype=dtype,
                         num_speculative_tokens=int(steps), target_name=name)
    write_stdout(out, (path / "README.md").read_text())
    return path


def main(args: Sequence[str]) -> None:
    """``specgen export ...`` (called by :func:`specgen.cli.main.main`)."""
    from transformers.utils import logging as hf_logging

    from specgen.config.compose import exits_on_error

    hf_logging.set_verbosity_error()
    try:
        with exits_on_error("specgen export"):
            run_export(args)
    except KeyboardInterrupt:
        sys.stderr.write("specgen export: cancelled\n")
        raise SystemExit(130) from None
