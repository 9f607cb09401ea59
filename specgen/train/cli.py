"""The ``specgen-train`` command: train a learned draft head for a target.

    specgen-train drafter=eagle target=smollm2-135m train.steps=2000 train.loss=lk train.out=heads/eagle.safetensors
    specgen-train target=tiny train.kind=mtp train.steps=50 train.out=/tmp/mtp.safetensors
    specgen-train target=tiny train.kind=dspark train.steps=30 train.out=/tmp/d.safetensors

stdout gets the held-out evaluation table; progress and notes go to stderr.
Errors a user can cause exit with status 2 and one line; ``train.out`` is
checked before anything loads. Ctrl-C during training saves a checkpoint and
exits with status 130 on one line naming it; earlier, it exits 130 with
``specgen-train: cancelled``. Before training, the disk of ``train.out`` must have room for the
head (and its checkpoints); a head file that still cannot be written (a full disk) is saved in the
temporary directory, /dev/shm or home instead, and the run exits with status 74 on one line naming
where it went. A checkpoint that cannot be written is skipped with a note; training goes on.
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import hydra
import torch
from omegaconf import DictConfig

from specgen.config.compose import compose, conf_dir, exits_on_error, run_console, to_container
from specgen.config.options import MAX_NUM_TOKENS
from specgen.heads.modules import MAX_MEDUSA_HEADS
from specgen.errors import ConfigError, OutputError
from specgen.config.options import parse_int
from specgen.outputs import write_failure, write_stdout
from specgen.config.paths import check_output_file

CONFIG_NAME = "train"

#: architecture defaults per kind (drafter.head.* and train.head.* override them)
HEAD_DEFAULTS = {
    "eagle": {"feature_layers": [], "intermediate_size": 1536, "num_heads": 4, "draft_vocab_size": 8192},
    # feature_layers None: low, middle and high target layers (see fused_layers); attention sized like the target's
    "eagle3": {"feature_layers": None, "intermediate_size": 1536, "num_heads": 4, "draft_vocab_size": 8192},
    "mtp": {"feature_layers": [], "intermediate_size": 1536, "num_heads": 4, "draft_vocab_size": 8192},
    "medusa": {"feature_layers": [], "intermediate_size": 1536, "num_heads": 4, "draft_vocab_size": 8192},
    "dspark": {"feature_layers": [], "intermediate_size": 1536, "num_heads": 4, "draft_vocab_size": 8192,
               "block_size": 6, "markov_rank": 64},
}
#: the architecture keys that are positive integers (a kind reads those in its defaults)
_SIZES = ("intermediate_size", "num_heads", "draft_vocab_size", "block_size", "markov_rank")
_STORE_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


@dataclass
class TrainRun:
    path: Path | None  # None when interrupted before the end (info then names the checkpoint)
    metrics: dict | None
    info: dict  # the train= metadata stored with the head
    table: str


def compose_train(overrides: Sequence[str] = ()) -> DictConfig:
    """Compose the train config like the command line does (for scripts and tests)."""
    return compose(overrides, config_name=CONFIG_NAME)


def head_settings(cfg: dict) -> tuple[str, dict]:
    """(kind, architecture) from train.kind / drafter.kind, drafter.head.* and train.head.*."""
    train, drafter = cfg["train"], cfg.get("drafter") or {}
    kind = train.get("kind") or drafter.get("kind")
    if kind not in HEAD_DEFAULTS:
        raise ConfigError(f"specgen-train trains eagle, eagle3, mtp, medusa or dspark heads; choose one with "
                          f"drafter=eagle (or train.kind=eagle), not {kind!r}")
    arch = dict(HEAD_DEFAULTS[kind])
    layers = [(drafter.get("head") or {}) if drafter.get("kind") == kind else {}, train.get("head") or {}]
    for layer in layers:
        arch.update({k: v for k, v in layer.items() if k in arch and v is not None})
    if arch["feature_layers"] is not None:
        arch["feature_layers"] = [int(i) for i in arch["feature_layers"]]
    for key in (k for k in _SIZES if k in arch):
        arch[key] = int(arch[key])
        if arch[key] < 1:
            raise ConfigError(f"train.head.{key} must be >= 1, got {arch[key]}")
    if kind == "medusa" and arch["num_heads"] > MAX_MEDUSA_HEADS:
        raise ConfigError(f"train.head.num_heads must be at most {MAX_MEDUSA_HEADS} (a Medusa head per draft "
                          f"position), got {arch['num_heads']}")
    if arch.get("block_size", 0) > MAX_NUM_TOKENS:
        raise ConfigError(f"train.head.block_size must be at most {MAX_NUM_TOKENS} (the most draft tokens a round "
                          f"verifies), got {arch['block_size']}")
    return kind, arch


def fused_layers(num_layers: int) -> list[int]:
    """EAGLE-3's low, middle and high features: the hidden states entering decoder
    layers 2, L // 2 and L - 3 (indices into HF's hidden-states tuple, 0 = embeddings)."""
    return sorted({min(2, num_layers), num_layers // 2, max(0, num_layers - 3)})


def attention_shape(config) -> dict:
    """An eagle3 head's attention sized like one of the target's layers."""
    heads = int(config.num_attention_heads)
    return {"num_attention_heads": heads,
            "num_key_value_heads": int(getattr(config, "num_key_value_heads", None) or heads),
            "head_dim": int(getattr(config, "head_dim", None) or config.hidden_size // heads),
            "rope_theta": float((getattr(config, "rope_parameters", None) or {}).get("rope_theta")
                                or getattr(config, "rope_theta", None) or 10000.0)}


def _kind_fields(kind: str, arch: dict, config) -> dict:
    """The HeadConfig fields only ``kind`` reads: eagle3's attention shape, dspark's block and rank."""
    if kind == "eagle3":
        return attention_shape(config)
    if kind == "dspark":
        return {"block_size": arch["block_size"], "markov_rank": arch["markov_rank"]}
    return {}


@dataclass
class _Job:
    """What ``run_train`` resolved from the config before loading anything."""

    train: dict
    target: dict
    kind: str
    arch: dict
    settings: object  # specgen.train.loop.Settings
    say: Callable[[str], None]
    store_dtype: torch.dtype
    threads: int
    device: torch.device
    dtype: torch.dtype
    out_path: Path
    export_dir: Path | None

    @property
    def checkpoint(self) -> Path:
        return self.out_path.with_name(self.out_path.name + ".ckpt")

    @property
    def progress(self) -> bool:
        return bool(self.train["progress"])


def _prepare(cfg, err) -> _Job:
    """Validate the config (``train.out`` included) into a :class:`_Job`; nothing is loaded."""
    from specgen.engine.assemble import set_threads
    from specgen.heads.export import train_export_dir
    from specgen.models import resolve_device, resolve_dtype
    from specgen.train.loop import Settings

    cfg = to_container(cfg) if not isinstance(cfg, dict) else cfg
    train = cfg["train"]
    kind, arch = head_settings(cfg)
    settings = Settings.from_config(train)
    progress = bool(train["progress"])
    say = (lambda m: (err.write(f"specgen-train: {m}\n"), err.flush())) if progress else (lambda m: None)
    store_dtype = _STORE_DTYPES.get(str(train["cache_dtype"]))
    if store_dtype is None:
        raise ConfigError(f"train.cache_dtype must be one of {', '.join(_STORE_DTYPES)}")
    for key in ("shard_tokens", "extract_tokens", "train_tokens"):
        if train.get(key) is not None:
            parse_int(train[key], f"train.{key}", minimum=1)
    threads = set_threads(train["threads"], "train.threads")
    device = resolve_device(str(train["device"]))
    dtype = resolve_dtype(str(train["dtype"]), device)
    out_path = Path(str(train.get("out") or f"heads/{kind}.safetensors"))
    check_output_file(out_path, "train.out", create_parents=True, example="head.safetensors")
    export_dir = train_export_dir(train.get("export"), kind, out_path, arch["feature_layers"])  # train.export=eagle3
    return _Job(train, cfg["target"], kind, arch, settings, say, store_dtype, threads, device, dtype, out_path,
                export_dir)


def _load_target(job: _Job):
    """-> (loaded model, HF model, fingerprint, feature layers to extract); resolves arch["feature_layers"]."""
    from specgen.heads.fingerprint import target_fingerprint
    from specgen.models import load_model

    loaded = load_model(job.target["source"], name="target", dtype=job.dtype, device=job.device,
                        extra_eos=tuple(job.target.get("eos_ids") or ()), progress=job.progress)
    model = loaded.lm.hf_model.eval().requires_grad_(False)
    num_states = int(model.config.num_hidden_layers) + 1
    if job.arch["feature_layers"] is None:
        job.arch["feature_layers"] = fused_layers(num_states - 1)
    if any(not -num_states <= i < num_states for i in job.arch["feature_layers"]):
        raise ConfigError(f"feature_layers {job.arch['feature_layers']} out of range for a target with "
                          f"{num_states} hidden states (0 = embeddings)")
    layers = [] if job.kind == "medusa" else job.arch["feature_layers"]
    return loaded, model, target_fingerprint(model), layers


#: Bytes a trained parameter takes: float32 weight, gradient and Adam's two moments.
TRAIN_BYTES_PER_PARAMETER = 16


def check_head_memory(job: _Job, model) -> None:
    """ConfigError where the head these settings make for ``model`` needs more memory to train (its
    weights, gradients and optimiser state, :data:`TRAIN_BYTES_PER_PARAMETER` each) than the device
    has available; counted on a meta-device head, so nothing is allocated."""
    from specgen.heads.kinds import meta_head
    from specgen.machine import available_memory, format_bytes

    arch = job.arch
    cfg = _head_config(job, model, min(arch["draft_vocab_size"], int(model.config.vocab_size)))
    need = sum(p.numel() for p in meta_head(cfg).parameters()) * TRAIN_BYTES_PER_PARAMETER
    free = torch.cuda.mem_get_info(job.device)[0] if job.device.type == "cuda" else available_memory()
    if free is not None and need > free:
        sizes = ", ".join(f"{key}={arch[key]}" for key in _SIZES if key in arch)
        raise ConfigError(f"a {job.kind} head with {sizes} needs {format_bytes(need)} to train (weights, gradients "
                          f"and optimiser state) but {format_bytes(free)} is available on {job.device}; "
                          "lower train.head.* sizes")


def _split_features(job: _Job, loaded, model, fingerprint: dict, layers: list[int]):
    """-> (corpora, features, extraction info), each keyed by "train" and "eval"."""
    from specgen.models.loading import writable_cache_dir
    from specgen.train.data import data_source, load_corpus
    from specgen.train.selfgen import BATCH, self_corpus
    from specgen.train.shards import cached_features

    train = job.train
    cache_dir = writable_cache_dir("train") if train["cache"] else None
    corpora, feats, speeds = {}, {}, {}
    for split, held_out in (("train", False), ("eval", True)):
        t0 = time.perf_counter()
        if data_source(train, job.target) == "self":
            corpora[split] = self_corpus(
                model, loaded.tokenizer, held_out=held_out,
                limit=int(train["eval_conversations" if held_out else "num_conversations"]),
                max_len=int(train["max_len"]), temperature=float(train["self_temperature"]),
                batch_size=int(train.get("self_batch") or BATCH), seed=job.settings.seed, fingerprint=fingerprint,
                cache_dir=cache_dir, progress=job.progress)
        else:
            corpora[split] = load_corpus(train, job.target, loaded.tokenizer, held_out=held_out)
        if not corpora[split].sequences:
            raise ConfigError(f"no {split} sequences: {corpora[split].description}")
        job.say(f"{split} data: {corpora[split].description} ({time.perf_counter() - t0:.1f} s)")
        feats[split], info = cached_features(
            model, corpora[split], layers, loaded.lm.vocab_size, fingerprint, cache_dir=cache_dir,
            store_dtype=job.store_dtype, shard_tokens=int(train.get("shard_tokens") or 32768),
            batch_tokens=int(train.get("extract_tokens") or 4096), progress=job.progress)
        speeds[split] = info
        job.say(f"{split} features: {info['tokens']} tokens, {info['shards']} shards " +
                ("(cached)" if info["cached"] else f"({info['reused']} reused); {info['new']} extracted in "
                 f"{info['seconds']:.1f} s = {info['tokens_per_s']:.0f} tokens/s ({job.threads} threads)"))
    return corpora, feats, speeds


def _new_head(job: _Job, model, loaded, corpus):
    """-> (head float32 on the device, attached; target id -> draft index lookup)."""
    from specgen.heads.kinds import build_head
    from specgen.train.data import draft_vocab
    from specgen.train.loop import draft_lookup

    vocab_size, arch = loaded.lm.vocab_size, job.arch
    vocab_ids = draft_vocab(corpus.sequences, arch["draft_vocab_size"], vocab_size, loaded.tokenizer.eos_ids)
    head_cfg = _head_config(job, model, len(vocab_ids))
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(job.settings.seed)
        head = build_head(head_cfg, vocab_ids)
    head = head.to(device=job.device, dtype=torch.float32)
    head.attach(model.get_input_embeddings().weight, model.get_output_embeddings().weight)
    return head, draft_lookup(vocab_ids, vocab_size)


def _head_config(job: _Job, model, draft_vocab_size: int):
    """The HeadConfig of the head ``job``'s settings make for ``model``."""
    from specgen.heads.modules import HeadConfig

    arch = job.arch
    return HeadConfig(kind=job.kind, hidden_size=int(model.config.hidden_size), draft_vocab_size=draft_vocab_size,
                      feature_layers=arch["feature_layers"], intermediate_size=arch["intermediate_size"],
                      num_heads=arch["num_heads"], **_kind_fields(job.kind, arch, model.config))


def _save(job: _Job, head, fingerprint, result, metrics, corpora, speeds, command: str) -> tuple[Path, dict]:
    """Write the head file with its training record; drop the checkpoint unless kept."""
    from specgen.heads.store import save_head

    s, tail = job.settings, result.losses[-50:]
    info = {"kind": job.kind, "loss": s.loss, "steps": s.steps, "batch_tokens": s.batch_tokens,
            "unroll": s.unroll, "lr": s.lr, "seconds": round(result.seconds, 2),
            "steps_per_s": round(result.steps_per_s, 3), "final_loss": round(sum(tail) / max(1, len(tail)), 5),
            "resumed_from": result.resumed_from, "eval_data": corpora["eval"].description,
            "train_tokens": sum(len(seq) for seq in corpora["train"].sequences), "metrics": metrics}
    save = partial(save_head, head=head, fingerprint=fingerprint, command=command, seed=s.seed,
                   data=corpora["train"].description, train=info)
    try:
        path = save(job.out_path)
    except OSError as exc:
        raise write_failure(job.out_path, exc, _rescue(save, job.out_path)) from None
    if not job.train["keep_checkpoint"]:
        job.checkpoint.unlink(missing_ok=True)
    return path, info


def _rescue(save: Callable[[Path], Path], out_path: Path) -> str:
    """Where the trained head went when ``train.out`` could not take it: the first of the temporary
    directory, /dev/shm and the home directory that holds it (the text of the one error line)."""
    name = f"{out_path.stem}-rescued-{os.getpid()}.safetensors"
    for folder in (Path(tempfile.gettempdir()), Path("/dev/shm"), Path.home()):
        if folder.is_dir() and folder.resolve() != out_path.parent.resolve():
            try:
                return f"the trained head is kept in {save(folder / name)}: move it to {out_path}"
            except OSError:
                continue
    return "the trained head could not be kept anywhere (tried the temporary directory, /dev/shm and home)"


def check_room(path: Path, head, checkpoints: bool) -> None:
    """OutputError before training when the disk of ``path`` (train.out) has less room than the head
    file needs (2 bytes a parameter, bfloat16) and, with ``checkpoints``, a checkpoint (float32
    weights and two AdamW moments: 12 bytes a parameter)."""
    params = sum(p.numel() for p in head.parameters() if p.requires_grad)
    need = 2 * params + (12 * params if checkpoints else 0) + (1 << 16)  # + 64 KiB for the metadata
    free = shutil.disk_usage(path.parent).free
    if free < need:
        raise OutputError(f"train.out={path}: its disk has {free / 2**20:,.1f} MiB free; the head"
                          f"{' and its checkpoints need' if checkpoints else ' needs'} about {need / 2**20:,.1f} MiB; "
                          "free space or choose another train.out (nothing was trained)")


def _export(job: _Job, head, model, fingerprint) -> None:
    """The vLLM / SGLang layout next to train.out, when train.export asks for it."""
    from specgen.heads.export import export_eagle3

    if job.export_dir is not None:
        try:
            export_eagle3(head, job.export_dir, target_config=model.config, fingerprint=fingerprint)
        except OutputError as exc:
            raise OutputError(f"{exc}; the trained head is saved in {job.out_path} (specgen export head="
                              f"{job.out_path} out={job.export_dir} exports it)") from None
        job.say(f"exported {job.export_dir} for vLLM / SGLang (serving commands in {job.export_dir / 'README.md'})")


def run_train(cfg, *, command: str = "", stop_after: int | None = None, out=None, err=None) -> TrainRun:
    """Load the target, build (or read cached) features, train, evaluate, save the head.

    An interrupted run (Ctrl-C or ``stop_after``) returns ``path=None`` with
    ``info["checkpoint"]`` and a one-line ``info["message"]``.
    """
    from specgen.train.data import first_tokens
    from specgen.train.evaluate import evaluate, table
    from specgen.train.loop import train_head

    out = sys.stdout if out is None else out
    job = _prepare(cfg, sys.stderr if err is None else err)
    loaded, model, fingerprint, layers = _load_target(job)
    check_head_memory(job, model)
    corpora, feats, speeds = _split_features(job, loaded, model, fingerprint, layers)
    if job.train.get("train_tokens") is not None:
        corpora["train"], feats["train"] = first_tokens(corpora["train"], feats["train"], int(job.train["train_tokens"]))
        job.say(f"training on {corpora['train'].description}")
    head, lookup = _new_head(job, model, loaded, corpora["train"])
    check_room(job.out_path, head, checkpoints=bool(job.settings.checkpoint_every))
    signature = {"head": head.cfg.to_json(), "data": corpora["train"].description,
                 "fingerprint": fingerprint["weights_sha256"], "vocab": head.vocab_ids.tolist()[:64]}
    result = train_head(head, feats["train"], lookup, job.settings, device=job.device, checkpoint=job.checkpoint,
                        resume=bool(job.train["resume"]), extra_signature=signature,
                        stop_after=stop_after, progress=job.progress)
    job.say(f"trained {result.steps - result.resumed_from} steps in {result.seconds:.1f} s = "
            f"{result.steps_per_s:.2f} steps/s ({job.threads} threads, {job.device})")
    if result.interrupted:
        message = (f"stopped at step {result.steps}/{job.settings.steps}; checkpoint saved to {job.checkpoint} "
                   "(run again with train.resume=true to continue)")
        return TrainRun(None, None, {"steps": result.steps, "checkpoint": str(job.checkpoint), "message": message}, "")
    metrics = evaluate(head, feats["eval"], lookup, unroll=job.settings.unroll, device=job.device)
    text = table(metrics)
    path, info = _save(job, head, fingerprint, result, metrics, corpora, speeds, command)
    write_stdout(out, f"{job.kind} head, loss {job.settings.loss}, {job.settings.steps} steps; held-out "
                      f"evaluation:\n\n{text}\n")
    job.say(f"saved {path}")
    _export(job, head, model, fingerprint)
    return TrainRun(path, metrics, info, text)


@hydra.main(config_path=str(conf_dir()), config_name=CONFIG_NAME, version_base=None)
def _hydra_main(cfg: DictConfig) -> None:
    from hydra.core.hydra_config import HydraConfig

    command = " ".join(["specgen-train", *HydraConfig.get().overrides.task])
    with exits_on_error("specgen-train"):
        run = run_train(cfg, command=command)
    if run.path is None:
        sys.stderr.write(f"specgen-train: interrupted: {run.info['message']}\n")
        raise SystemExit(130)


def main() -> None:
    """Console entry point (``specgen-train``): quiet HF, hand over to Hydra."""
    run_console(_hydra_main, "specgen-train", CONFIG_NAME)


if __name__ == "__main__":
    main()
