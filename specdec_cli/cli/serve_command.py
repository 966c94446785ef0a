"""``specdec serve``: check the options, load the session, bind, serve until Ctrl-C or SIGTERM."""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import re
import signal
import socket
import sys
import time
from dataclasses import dataclass
from typing import Optional

import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from ..model import bundled, distributed
from ..model.prompts import tools_note
from .commands import join
from .display import print_loading, print_stderr
from ..defaults import KNEE_GAIN
from ..drafters import kinds
from ..errors import OptionError
from ..cache.limits import gb
from ..session.batch import auto_concurrency, batch_refusal
from ..session.corpus import DEFAULT_TOKENS
from ..session import (
    Corpus,
    PromptCache,
    RunOptions,
    Session,
    check_distributed_options,
    check_model_options,
    load_setup,
    resolve_block_size,
    sampling_params,
)
from ..serve.app import create_app
from ..serve.service import Service

log = logging.getLogger("specdec.serve")
# uvicorn's own wait for open connections once asked to stop; generation is
# cancelled at once and each block is short, so this bounds shutdown.
GRACEFUL_S = 0.5
# A connection must send a request's whole headers this soon after it opens (or after its
# last answer): half-sent headers cannot hold a connection open for free.
HEADERS_TIMEOUT_S = 10.0
# An idle kept-alive connection is closed after this long (uvicorn's default, said here).
KEEP_ALIVE_S = 5


@dataclass
class ServeOptions(RunOptions):
    """Everything ``specdec serve`` was asked to do (sampling options are the requests' defaults)."""

    max_tokens: int = 512
    host: str = "127.0.0.1"
    port: int = 8080
    api_key: Optional[str] = None
    no_api_key: bool = False
    allow_origin: Optional[list[str]] = None
    prompt_cache_size: int = 10
    prompt_cache_bytes: Optional[int] = None
    queue_size: int = 16
    decode_concurrency: Optional[int] = None  # None: chosen at start-up (session.batch.auto_concurrency)
    lookup_corpus: int = DEFAULT_TOKENS
    log_level: str = "info"


def is_loopback(host: str) -> bool:
    """Whether ``host`` only accepts connections from this machine."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def check_access(opts: ServeOptions) -> Optional[str]:
    """Refuse an open bind without a decision on keys; returns the warning an open, keyless bind gets."""
    if opts.api_key is not None and opts.no_api_key:
        raise OptionError("give --api-key KEY or --no-api-key, not both")
    if opts.api_key is not None and not opts.api_key.strip():
        raise OptionError("--api-key is empty: give a key, or --no-api-key to serve without one")
    if is_loopback(opts.host) or opts.api_key is not None:
        return None
    if not opts.no_api_key:
        raise OptionError(f"--host {opts.host} lets other machines in: protect it with --api-key KEY, or pass "
                          "--no-api-key to serve it without one")
    return (f"serving on {opts.host} without an API key: anyone who can reach port {opts.port} there can "
            "use the model")


def check_origins(origins: Optional[list[str]]) -> list[str]:
    """``--allow-origin`` values: ``*``, or origins as a browser sends them (scheme://host[:port], no path)."""
    for origin in origins or ():
        if origin != "*" and not re.fullmatch(r"https?://[^/\s?#]+", origin):
            raise OptionError(f"--allow-origin takes an origin like http://localhost:3000 (scheme, host and port, "
                              f"no path), or * for any (got {origin!r})")
    return list(origins or ())


def bind(host: str, port: int) -> socket.socket:
    """A listening socket (bound here, so a port in use is one clear line)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        why = "is in use: pass another --port" if e.errno in (98, 48) else f"cannot be bound ({e.strerror})"
        raise OptionError(f"{host}:{port} {why}") from None
    sock.listen(128)
    sock.set_inheritable(True)
    return sock


def concurrency_line(rows: int, steps: dict[int, float]) -> str:
    """What the start-up measurement chose for ``--decode-concurrency`` and why, in one line."""
    rates = ", ".join(f"{b}: {b / s:.0f}" for b, s in sorted(steps.items()))
    why = "the most tried" if rows == max(steps) else f"no more rows added {KNEE_GAIN:.0%} a doubling"
    return (f"decode concurrency {rows}, chosen at start-up ({why}; tokens/s of a one-token step by rows: "
            f"{rates}); --decode-concurrency sets it")


def serve_command(opts: ServeOptions) -> int:
    """Run ``specdec serve``; returns the exit code (under ``mlx.launch``, on every rank: rank 0 serves HTTP)."""
    with distributed.peer_errors():
        return _serve(opts)


def _serve(opts: ServeOptions) -> int:
    ranks = join(opts)
    kind = check_model_options(opts)
    check_distributed_options(opts, kind, ranks is not None)
    block_size = resolve_block_size(opts.block_size, opts.num_draft_tokens, kind)
    sampling_params(opts.temp, opts.top_p, opts.top_k, opts.min_p)
    if opts.prompt_cache_size < 0 or (opts.prompt_cache_bytes is not None and opts.prompt_cache_bytes < 0):
        raise OptionError("--prompt-cache-size and --prompt-cache-bytes must be >= 0")
    warning = check_access(opts)
    origins = check_origins(opts.allow_origin)
    primary = ranks is None or ranks.primary
    sock = bind(opts.host, opts.port) if primary else None  # rank 0 alone serves HTTP
    print_loading(opts.model, opts.draft_model)
    setup = load_setup(opts, kind, ranks)
    setup.check_ranks([])
    setup.memory  # measured here, on this thread: requests are checked against it with no MLX work of their own
    block_size = setup.run_block_size(block_size)
    # --prompt-cache-bytes 0 turns the cache off as --prompt-cache-size 0 does (nothing could be kept).
    on = opts.prompt_cache_size > 0 and opts.prompt_cache_bytes != 0
    cache = PromptCache(opts.prompt_cache_size, opts.prompt_cache_bytes) if on else None
    # Lookup rows also draft from recent answers (other drafters have nothing to copy with).
    corpus = Corpus(opts.lookup_corpus) if opts.lookup_corpus and kinds.kind(setup.kind).earlier else None
    session = Session(setup, block_size, adaptive=opts.adaptive, prompt_cache=cache, corpus=corpus)
    disk_warning = session.use_disk(opts.prompt_cache_dir, opts.prompt_cache_disk_gb)
    batching = None
    rounding_note = None
    if opts.decode_concurrency is None or opts.decode_concurrency > 1:
        problem = batch_refusal(session)
        if ranks is not None:
            problem = ranks.broadcast(problem)  # every rank batches as rank 0 decided
        if problem:
            batching = f"note: requests are decoded one at a time: {problem}"
            opts.decode_concurrency = 1
        elif session.rounding.batched > 0:
            rounding_note = (f"note: {session.rounding.line()}: a batched answer is its request's text alone, or "
                             "parts from it where the two likeliest tokens are within that (docs/EXACTNESS.md)")
    if opts.decode_concurrency is None:
        # As many rows as still pay: measured here, before the first request (docs/SERVER.md).
        opts.decode_concurrency, steps = auto_concurrency(session)
        batching = concurrency_line(opts.decode_concurrency, steps)
    # The id clients send back: what --model named, or the bundled model's own name.
    name = opts.model if opts.model is not None else bundled.NAME
    service = Service(session, name, opts, opts.queue_size, opts.decode_concurrency)
    # What a batch's forward costs by rows x tokens, measured now: never on a request's time.
    start = time.perf_counter()
    costs = service.scheduler.prepare()
    seconds = time.perf_counter() - start
    costs_line = None if costs is None else (f"batch forward costs measured at start-up in {seconds:.1f} s "
                                             f"({len(costs.cells)} cells of rows x tokens)")
    if not primary:
        _logging("warning")
        # Ctrl-C reaches every rank in a terminal: rank 0 stops serving and its last pass stops this one.
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        service.scheduler.follow()  # rank 0's loop passes, until it stops
        return 0
    app = create_app(service, api_key=opts.api_key, allow_origins=origins)
    host, port = sock.getsockname()[:2]
    where = f"[{host}]" if ":" in host else host
    tools = tools_note(setup.tokenizer, setup.template_kwargs)
    print_stderr(setup.start_lines() + [f"warning: {w}" for w in (warning, disk_warning) if w]
                 + ([f"note: {tools}"] if tools else [])
                 + ([batching] if batching else []) + ([rounding_note] if rounding_note else [])
                 + ([costs_line] if costs_line else []))
    cached = f"prompt cache {cache.max_entries} entries, up to {gb(cache.max_bytes)}" if cache is not None \
        else "no prompt cache"
    if session.disk is not None:
        cached += f"; {session.disk.line()}"
    if corpus is not None:
        cached += f"; lookup corpus of recent answers up to {corpus.max_tokens} tokens"
        if corpus.tokens:
            cached += f" ({corpus.tokens} kept from the last run)"
    print_stderr([f"{setup.model_line}, served as {name!r}; drafter {setup.drafter_name}, block size "
                  f"{block_size}; {cached}; up to {opts.decode_concurrency} requests decoded together",
                  *([ranks.line] if ranks is not None else []),
                  f"serving the OpenAI API on http://{where}:{port}/v1 (Ctrl-C stops)"])
    _logging(opts.log_level)
    config = uvicorn.Config(app, log_level=opts.log_level, access_log=opts.log_level == "debug",
                            timeout_graceful_shutdown=GRACEFUL_S, lifespan="on", log_config=None,
                            http=TimedH11Protocol, timeout_keep_alive=KEEP_ALIVE_S)
    server = _Server(config, service)
    try:
        server.run(sockets=[sock])
    except KeyboardInterrupt:
        pass  # uvicorn raises the signal it caught again once it has shut down: stopping is the normal end
    finally:
        if ranks is not None:
            service.scheduler.wait(distributed.deadline())  # its last pass tells the other ranks to stop
        session.shutdown()  # what answers left behind reaches the disk before the process ends
    fault = service.scheduler.fault
    if fault is not None and ranks is not None:
        raise fault  # the ranks cannot serve on: the error's one line, and a non-zero exit
    return 0


class TimedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol, which also closes a connection whose request headers come too slowly.

    uvicorn times out idle kept-alive connections, but not one that was just
    opened, nor one sending its headers a byte at a time.
    """

    _headers_timer: Optional[asyncio.TimerHandle] = None

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        self._wait_for_headers()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        if self._between_requests():
            self._wait_for_headers()  # the start of a request: its headers must come in time
        elif self._headers_timer is not None:
            self._headers_timer.cancel()
            self._headers_timer = None

    def connection_lost(self, exc) -> None:
        if self._headers_timer is not None:
            self._headers_timer.cancel()
        super().connection_lost(exc)

    def _between_requests(self) -> bool:
        return self.cycle is None or self.cycle.response_complete

    def _wait_for_headers(self) -> None:
        if self._headers_timer is None:
            self._headers_timer = self.loop.call_later(HEADERS_TIMEOUT_S, self._headers_late)

    def _headers_late(self) -> None:
        self._headers_timer = None
        if self._between_requests() and not self.transport.is_closing():
            log.info("closed a connection that sent no whole request headers within %.0f s", HEADERS_TIMEOUT_S)
            self.transport.close()


class _Server(uvicorn.Server):
    """uvicorn's server, which also cancels generation the moment it is asked to stop."""

    def __init__(self, config: uvicorn.Config, service: Service):
        super().__init__(config)
        self.service = service

    def handle_exit(self, sig, frame) -> None:
        self.service.scheduler.stop(timeout=0)  # streams end now, with an error frame
        super().handle_exit(sig, frame)

    async def on_tick(self, counter: int) -> bool:
        # Ranks that lost or disagree with each other cannot serve on: the server stops (and exits non-zero).
        if self.service.session.ranks is not None and self.service.scheduler.fault is not None:
            return True
        return await super().on_tick(counter)


def _logging(level: str) -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(asctime)s %(message)s", "%H:%M:%S"))
    for name in ("specdec", "uvicorn", "uvicorn.error"):
        logger = logging.getLogger(name)
        logger.handlers[:] = [handler]
        logger.setLevel(level.upper())
        logger.propagate = False
