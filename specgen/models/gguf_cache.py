"""The specgen cache and the GGUF conversions kept in it.

``cache_root()`` is ``$SPECGEN_CACHE`` or ``~/.cache/specgen``. A GGUF file is
converted once (dequantised) to ``model.safetensors`` plus tokenizer files under
``cache_root()/converted/<sha256 of the gguf>`` (suffixed ``-<cache_dtype>`` unless
float32). A conversion is written to a temporary directory and renamed into place,
so an interrupted conversion never leaves a partial cache entry; a complete entry
holds ``config.json``, ``model.safetensors`` and the source marker. A run on llama.cpp needs
only the tokenizer: :func:`tokenizer_files` writes it alone under ``cache_root()/tokenizers/<sha256>``.
File hashes are remembered by (path, size, mtime) so an unchanged file is not hashed again.
"""

from __future__ import annotations

import hashlib
import json
import os
import pathlib
import shutil
import struct
import sys
import tempfile
import time

import torch

from specgen.errors import ModelLoadError

_MARKER = "specgen_source.json"
_TMP_PREFIX = ".tmp-"
_HASH_INDEX = "sha256-index.json"
_CHUNK = 8 * 1024 * 1024
_SECONDS_PER_MB = 0.06
CACHE_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


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


def cache_dtype(source: Mapping) -> str:
    """The validated ``cache_dtype`` of a GGUF source (default ``float32``)."""
    name = str(source.get("cache_dtype") or "float32")
    if name not in CACHE_DTYPES:
        raise ModelLoadError(f"cache_dtype {name!r} is not one of {', '.join(CACHE_DTYPES)}")
    return name


def converted_dir(sha256: str, cache_dtype: str) -> pathlib.Path:
    """Cache directory for the conversion of the GGUF file with this sha256, stored in ``cache_dtype``."""
    suffix = "" if cache_dtype == "float32" else f"-{cache_dtype}"
    return cache_root() / "converted" / f"{sha256}{suffix}"


def is_complete(path: pathlib.Path) -> bool:
    """Whether a conversion cache entry holds everything a load needs."""
    return all((path / name).is_file() for name in ("config.json", "model.safetensors", _MARKER))


def converted(gguf_path: pathlib.Path, cache_dtype: str, progress: bool) -> pathlib.Path:
    """Cache directory holding ``gguf_path`` as ``cache_dtype`` safetensors, converting it if needed."""
    check_gguf_file(gguf_path)
    target = converted_dir(file_sha256(gguf_path), cache_dtype)
    if _present(target, is_complete):
        return target
    say(progress, _conversion_notice(gguf_path))
    started = time.monotonic()
    _write_entry(target, gguf_path, lambda tmp: _convert_gguf(gguf_path, tmp, CACHE_DTYPES[cache_dtype]))
    say(progress, f"converted {gguf_path.name} in {time.monotonic() - started:.0f} s -> {target}")
    return target


def _present(target: pathlib.Path, complete) -> bool:
    """Whether the cache entry ``target`` is ``complete``; an incomplete one (left by an older version:
    entries are installed whole) is removed. A process sharing the cache can install the entry between
    a first look and the removal, so it is looked at again first: a complete entry is never removed."""
    if complete(target):
        return True
    if target.exists():
        if complete(target):
            return True
        shutil.rmtree(target, ignore_errors=True)
    return False


def _install(tmp: pathlib.Path, target: pathlib.Path) -> None:
    """Atomically rename ``tmp`` to ``target``; keep a complete entry another process installed first."""
    try:
        os.rename(tmp, target)
    except OSError:
        if not is_complete(target):
            raise


def say(progress: bool, message: str) -> None:
    """Print a one-line progress message to stderr when ``progress`` is on."""
    if progress:
        print(f"specgen: {message}", file=sys.stderr, flush=True)


#: The fewest bytes a GGUF header spends on one tensor's entry (name length, dims, type, offset) and on
#: one metadata entry (key length, value type, a value): counts beyond what a file's size allows are corrupt.
GGUF_TENSOR_MIN_BYTES, GGUF_KV_MIN_BYTES = 8 + 4 + 8 + 4 + 8, 8 + 4 + 1


def check_gguf_file(path: pathlib.Path) -> None:
    """Raise :class:`ModelLoadError` unless ``path`` is an existing regular file with the GGUF magic
    bytes and header counts (tensors, metadata entries) that a file of its size can hold."""
    if not path.exists():
        raise ModelLoadError(f"GGUF file {path} does not exist; fix 'path' in the model source")
    if not path.is_file():
        what = "a directory" if path.is_dir() else "not a regular file"
        raise ModelLoadError(f"GGUF file {path} is {what}; give the path of a .gguf file")
    with open(path, "rb") as handle:
        header = handle.read(24)
    if header[:4] != b"GGUF":
        raise ModelLoadError(f"{path} is not a GGUF file (it does not start with the 'GGUF' magic bytes)")
    if len(header) < 24:
        return  # cut inside its header: reading the header says so
    tensors, entries = struct.unpack_from("<QQ", header, 8)
    size = path.stat().st_size
    if tensors * GGUF_TENSOR_MIN_BYTES + entries * GGUF_KV_MIN_BYTES > size:
        raise ModelLoadError(f"{path} is a corrupt GGUF file: its header counts {tensors} tensors and {entries} "
                             f"metadata entries, more than its {size} bytes can hold")


def file_sha256(path: pathlib.Path) -> str:
    """sha256 of ``path``, remembered in the cache by (path, size, mtime) to avoid rehashing."""
    path = path.resolve()
    stat = path.stat()
    entry = read_json(cache_root() / _HASH_INDEX).get(str(path))
    if isinstance(entry, list) and entry[:2] == [stat.st_size, stat.st_mtime_ns]:
        return str(entry[2])
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while chunk := handle.read(_CHUNK):
            digest.update(chunk)
    remember_sha256(path, digest.hexdigest())
    return digest.hexdigest()


def remember_sha256(path: pathlib.Path, sha256: str) -> None:
    """Record that ``path``, as it is now on disk, has this sha256 (best effort: an unwritable cache only
    costs a rehash next time)."""
    path = path.resolve()
    stat = path.stat()
    index_path = cache_root() / _HASH_INDEX
    index = read_json(index_path)
    index[str(path)] = [stat.st_size, stat.st_mtime_ns, sha256]
    try:
        write_json_atomic(index_path, index)
    except OSError:
        pass


def read_json(path: pathlib.Path) -> dict:
    """The JSON object in ``path``; an empty dict if it is absent or unreadable."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def write_json_atomic(path: pathlib.Path, data: dict) -> None:
    """Write ``data`` as JSON to ``path`` via a temporary file and rename."""
    path.parent.mkdir(parents=True, exist_ok=True)
    handle, name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    tmp = pathlib.Path(name)
    try:
        with os.fdopen(handle, "w") as out:
            out.write(json.dumps(data, indent=1))
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


def tokenizer_files(gguf_path: pathlib.Path, progress: bool) -> pathlib.Path:
    """Cache directory holding ``gguf_path``'s tokenizer and generation config, read from its metadata
    once (the weights are not converted: what a GGUF run on llama.cpp needs). The files are those a
    conversion writes."""
    from transformers import GenerationConfig

    check_gguf_file(gguf_path)
    target = cache_root() / "tokenizers" / file_sha256(gguf_path)
    if _present(target, lambda path: (path / _MARKER).is_file()):
        return target
    say(progress, f"reading the tokenizer of {gguf_path.name} (one-time) ...")

    def write(tmp: pathlib.Path) -> None:
        config, tokenizer = _read_gguf(gguf_path, lambda: _gguf_config(gguf_path))
        tokenizer.save_pretrained(str(tmp))
        GenerationConfig.from_model_config(config).save_pretrained(str(tmp))

    _write_entry(target, gguf_path, write)
    return target


def _write_entry(target: pathlib.Path, gguf_path: pathlib.Path, write) -> None:
    """Make the cache entry ``target`` for ``gguf_path``: ``write(tmp)`` fills a temporary directory
    beside it, which gets the source marker and is renamed into place (nothing partial is left)."""
    writable_cache_dir(*target.parent.relative_to(cache_root()).parts)
    _remove_stale_temps(target.parent)
    tmp = pathlib.Path(tempfile.mkdtemp(prefix=f"{_TMP_PREFIX}{os.getpid()}-", dir=target.parent))
    try:
        write(tmp)
        tmp.chmod(0o755)
        (tmp / _MARKER).write_text(json.dumps({"source": str(gguf_path), "name": gguf_path.name}))
        _install(tmp, target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _convert_gguf(gguf_path: pathlib.Path, out_dir: pathlib.Path, dtype: torch.dtype) -> None:
    """Write ``gguf_path`` dequantised, in ``dtype``, as an HF directory (safetensors + tokenizer)."""
    model, tokenizer = _read_gguf(gguf_path, lambda: _dequantised_model(gguf_path))
    model.to(dtype).save_pretrained(str(out_dir))
    tokenizer.save_pretrained(str(out_dir))


def _read_gguf(gguf_path: pathlib.Path, read):
    """``(read(), tokenizer)`` of ``gguf_path`` (the tokenizer with the GGUF's chat template);
    ModelLoadError naming the file when either cannot be read."""
    from transformers import AutoTokenizer

    try:
        value = read()
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
    return value, tokenizer


def _gguf_config(gguf_path: pathlib.Path):
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)


def _dequantised_model(gguf_path: pathlib.Path):
    """A float32 model with the GGUF's dequantised weights.

    ``from_pretrained(gguf_file=...)`` is not used: in transformers 5 it needs
    ``accelerate`` and returns a model that refuses ``save_pretrained``.
    """
    from transformers import AutoModelForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    config = _gguf_config(gguf_path)
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
