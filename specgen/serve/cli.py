"""The ``specgen-serve`` command: Hydra overrides in, uvicorn serving the app out.

``specgen-serve target=... drafter=... port=8000`` composes ``conf/serve.yaml``
(specgen's config plus ``host``, ``port``, ``batch_size`` and ``max_request_bytes``), checks every value before any
model is loaded (a bad one: one ``specgen-serve: error: ...`` line, status 2),
builds the pipeline and serves it on ``host:port`` (127.0.0.1 by default).
"""

from __future__ import annotations

import ipaddress
import logging
import socket
import sys
from collections.abc import Mapping
from dataclasses import dataclass

import hydra
from omegaconf import DictConfig

from specgen.config.checks import required
from specgen.config.compose import conf_dir, exits_on_error, run_console, to_container
from specgen.errors import ConfigError
from specgen.config.options import parse_batch_size, parse_int
from specgen.config.run import RunConfig

#: Keys of the shared config that only a one-shot run uses.
_ONE_SHOT_KEYS = ("prompt", "prompt_file", "output", "resume")
#: The smallest request-body limit: room for a short request.
MIN_REQUEST_BYTES = 1024


@dataclass(frozen=True)
class ServerConfig:
    """A server's checked settings: the run's :class:`RunConfig` (its ``batch_size`` None: the server
    sizes its own batches) and where and how it listens."""

    run: RunConfig
    host: str
    port: int
    batch_size: int
    max_request_bytes: int


def check_server_config(cfg: Mapping) -> ServerConfig:
    """``cfg``'s run values checked into its one :class:`RunConfig`, and ``host`` / ``port`` /
    ``batch_size`` / ``max_request_bytes`` too (their defaults: conf/serve.yaml): host a non-empty name or
    address without spaces, port an int in [1, 65535], batch_size an int in [1, MAX_BATCH_SIZE],
    max_request_bytes an int of at least MIN_REQUEST_BYTES. The one-shot keys
    (prompt, prompt_file, output, resume) are refused rather than ignored."""
    # batch_size is checked here: an unbatchable drafter makes the server serial, not an error
    run = RunConfig.from_cfg({key: value for key, value in cfg.items() if key != "batch_size"})
    for key in _ONE_SHOT_KEYS:
        if run.checked[key] not in (None, False):
            raise ConfigError(f"{key}= is for the specgen command; specgen-serve takes its prompts from requests")
    host = required(cfg, "host")
    if not isinstance(host, str) or not host.strip() or any(ch.isspace() for ch in host):
        raise ConfigError(f"host must be a host name or IP address such as 127.0.0.1, got {host!r}")
    return ServerConfig(run, host, parse_int(required(cfg, "port"), "port", minimum=1, maximum=65535),
                        parse_batch_size(required(cfg, "batch_size")),
                        parse_int(required(cfg, "max_request_bytes"), "max_request_bytes", minimum=MIN_REQUEST_BYTES))


def base_url(host: str, port: int) -> str:
    """The API's base URL on ``host:port``, an IPv6 address in brackets (``http://[::]:8000/v1``)."""
    return f"http://{f'[{host}]' if ':' in host else host}:{port}/v1"


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def serve(cfg: Mapping, err=None) -> None:
    """Check ``cfg``, build its pipeline and serve it until interrupted."""
    import uvicorn

    from specgen.engine.assemble import build_pipeline
    from specgen.serve.app import create_app, served_model_name
    from specgen.serve.worker import make_scheduler

    err = sys.stderr if err is None else err
    cfg = check_server_config(cfg)
    show_log(err)
    host, port = cfg.host, cfg.port
    sock = bind(host, port)
    pipe = build_pipeline(cfg.run)
    if not _is_loopback(host):
        err.write(f"specgen-serve: warning: listening on {host}, reachable from other machines; "
                  "there is no authentication\n")
    scheduler = make_scheduler(pipe, cfg.batch_size)
    err.write(f"specgen-serve: model {served_model_name(pipe)!r} [{pipe.guarantee.label()}] on {base_url(host, port)} "
              f"({scheduler.info['note']})\n")
    app = create_app(pipe, scheduler=scheduler, max_request_bytes=cfg.max_request_bytes)
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
    server.run(sockets=[sock])


class _LineFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        return f"specgen-serve: {record.levelname.lower()}: {super().format(record)}"


def show_log(err) -> None:
    """Write specgen's log records of level WARNING and above to ``err``, one ``specgen-serve: warning: ...``
    line each (an exception's traceback after its line). Hydra's job-logging config switches off the
    loggers that exist when it runs; specgen's are switched back on."""
    for name, logger in logging.Logger.manager.loggerDict.items():
        if (name == "specgen" or name.startswith("specgen.")) and isinstance(logger, logging.Logger):
            logger.disabled = False
    root = logging.getLogger("specgen")
    handler = logging.StreamHandler(err)
    handler.setFormatter(_LineFormatter())
    root.addHandler(handler)
    root.setLevel(logging.WARNING)
    root.propagate = False


def bind(host: str, port: int) -> socket.socket:
    """A listening socket on ``host:port``, bound before the model loads; ConfigError when it cannot be."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as exc:
        raise ConfigError(f"host={host} cannot be resolved: {exc.strerror}") from None
    family, kind, proto, _, address = infos[0]
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(address)
        sock.listen(128)
    except OSError as exc:
        sock.close()
        raise ConfigError(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from None
    return sock


@hydra.main(config_path=str(conf_dir()), config_name="serve", version_base=None)
def _hydra_main(cfg: DictConfig) -> None:
    with exits_on_error("specgen-serve"):
        serve(to_container(cfg))


def main() -> None:
    """Console entry point: check the overrides (one line, status 2), quote free text, hand over to Hydra."""
    run_console(_hydra_main, "specgen-serve", "serve")
