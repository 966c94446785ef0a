"""Which BLAS MLX's CPU backend runs on (Linux), and getting it onto OpenBLAS.

MLX's Linux CPU wheel bundles netlib's reference BLAS (``mlx_cpu.libs/libblas-*.so``):
batched float32 matmuls, the verify forward, are 15-30x slower on it than on
OpenBLAS, so speculative decoding cannot win. A library in ``LD_PRELOAD`` wins
symbol resolution over it, but the dynamic loader reads ``LD_PRELOAD`` only when
a process starts: so the command line re-executes itself once with it set
(:func:`maybe_reexec`, called before mlx is imported). The probes are separate
from the decision (:func:`decide`, a pure function) so the logic is testable.
Never used on macOS (MLX uses Accelerate there). Nothing here imports mlx at
module level.
"""

from __future__ import annotations

import glob
import importlib.util
import json
import os
import platform
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

# Set in the re-executed process, so it never re-executes again.
MARKER = "SPECDEC_BLAS_REEXEC"
# Set to 1 to keep the process as started (no re-exec, no hint).
OPT_OUT = "SPECDEC_NO_REEXEC"
INSTALL_HINT = "sudo apt-get install libopenblas0-pthread"

# System OpenBLAS builds, most likely first ({multiarch} is e.g. x86_64-linux-gnu).
OPENBLAS_CANDIDATES = (
    "/usr/lib/{multiarch}/openblas-pthread/libblas.so.3",  # Debian/Ubuntu libopenblas0-pthread
    "/usr/lib/{multiarch}/openblas-openmp/libblas.so.3",  # Debian/Ubuntu libopenblas0-openmp
    "/usr/lib/{multiarch}/openblas-serial/libblas.so.3",  # Debian/Ubuntu libopenblas0-serial
    "/usr/lib/{multiarch}/libopenblas.so.0",
    "/usr/lib64/libopenblasp.so.0",  # Fedora/RHEL openblas-threads
    "/usr/lib64/libopenblas.so.0",  # Fedora/RHEL/openSUSE
    "/usr/lib/libopenblas.so.0",  # Arch, Alpine
)


@dataclass(frozen=True)
class Probe:
    """What start-up found out, without importing mlx.

    Attributes:
        system: ``sys.platform``.
        bundled_blas: The reference BLAS shipped in the installed mlx wheel, if any.
        system_openblas: The first system OpenBLAS found, if any.
        ld_preload: ``LD_PRELOAD`` as the process was started.
        reexeced: This process is the re-executed one (the marker is set).
        opted_out: ``SPECDEC_NO_REEXEC`` is set.
    """

    system: str
    bundled_blas: Optional[str]
    system_openblas: Optional[str]
    ld_preload: str = ""
    reexeced: bool = False
    opted_out: bool = False


@dataclass(frozen=True)
class Decision:
    """What to do at start-up: ``reexec`` (with ``ld_preload``), ``hint`` or ``none``."""

    action: str
    reason: str
    ld_preload: Optional[str] = None


def _truthy(value: Optional[str]) -> bool:
    return (value or "").strip().lower() not in ("", "0", "false", "no")


def find_bundled_blas() -> Optional[str]:
    """The reference BLAS inside the installed mlx wheel (``mlx*.libs/libblas*``), if any."""
    spec = importlib.util.find_spec("mlx")  # a namespace package: nothing is imported
    if spec is None or not spec.submodule_search_locations:
        return None
    for location in spec.submodule_search_locations:
        site = Path(location).parent
        for pattern in ("mlx*.libs/libblas*.so*", "mlx/lib/libblas*.so*"):
            found = sorted(glob.glob(str(site / pattern)))
            if found:
                return found[0]
    return None


def find_system_openblas(candidates=OPENBLAS_CANDIDATES) -> Optional[str]:
    """The first system OpenBLAS library that exists."""
    multiarch = f"{platform.machine()}-linux-gnu"
    for pattern in candidates:
        path = pattern.format(multiarch=multiarch)
        if os.path.isfile(path):
            return path
    return None


def probe(environ=None) -> Probe:
    """Look at the platform, the mlx install, the system libraries and the environment."""
    environ = os.environ if environ is None else environ
    linux = sys.platform.startswith("linux")
    return Probe(
        system=sys.platform,
        bundled_blas=find_bundled_blas() if linux else None,
        system_openblas=find_system_openblas() if linux else None,
        ld_preload=environ.get("LD_PRELOAD", ""),
        reexeced=_truthy(environ.get(MARKER)),
        opted_out=_truthy(environ.get(OPT_OUT)),
    )


def _preloads_openblas(ld_preload: str) -> bool:
    # LD_PRELOAD separates entries by colons or spaces.
    return any("openblas" in entry.lower() for entry in ld_preload.replace(":", " ").split())


def decide(p: Probe) -> Decision:
    """Whether to re-execute with OpenBLAS preloaded, print a hint, or do nothing."""
    if not p.system.startswith("linux"):
        return Decision("none", "not Linux: MLX does not use the bundled reference BLAS here")
    if p.bundled_blas is None:
        return Decision("none", "the installed mlx has no bundled reference BLAS")
    if _preloads_openblas(p.ld_preload):
        return Decision("none", "OpenBLAS is already in LD_PRELOAD")
    if p.reexeced:
        return Decision("none", f"already re-executed ({MARKER} is set)")
    if p.opted_out:
        return Decision("none", f"{OPT_OUT} is set")
    if p.system_openblas is None:
        return Decision("hint", "no system OpenBLAS installed")
    preload = p.system_openblas + (":" + p.ld_preload if p.ld_preload.strip() else "")
    return Decision("reexec", f"preloading the system OpenBLAS {p.system_openblas}", preload)


def maybe_reexec(environ=None) -> Decision:
    """Re-execute this process once with the system OpenBLAS preloaded, when that helps.

    Returns the decision when no re-exec happens (on success this never returns).
    A failed exec is ignored: the process goes on as started.
    """
    environ = os.environ if environ is None else environ
    decision = decide(probe(environ))
    if decision.action != "reexec" or not sys.executable:
        return decision
    env = dict(environ)
    env["LD_PRELOAD"] = decision.ld_preload
    env[MARKER] = "1"
    threads = rank_threads(environ)
    if threads is not None:
        env["OPENBLAS_NUM_THREADS"] = str(threads)
    sys.stdout.flush()
    sys.stderr.flush()
    try:
        # orig_argv is the command line as started: `python -m specdec_cli ...` or the script.
        os.execve(sys.executable, list(sys.orig_argv), env)
    except OSError:
        pass
    return Decision("none", f"re-executing with {decision.ld_preload} failed")


def local_ranks(environ=None) -> int:
    """How many of ``mlx.launch``'s ring ranks run on this machine (its hostfile's loopback entries; 0: none)."""
    environ = os.environ if environ is None else environ
    path = environ.get("MLX_HOSTFILE")
    if not path:
        return 0
    try:
        hosts = json.loads(Path(path).read_text() or "[]")
    except (OSError, ValueError):
        return 0
    if not isinstance(hosts, list):
        return 0
    return sum(1 for h in hosts if isinstance(h, list) and h and all(str(a).startswith("127.") for a in h))


def rank_threads(environ=None) -> Optional[int]:
    """OpenBLAS threads per rank when several ranks share this machine's cores (None: leave it be).

    OpenBLAS's threads spin while they wait, as the ring's ranks do: three ranks
    with two threads each on two cores made a 48-row verify forward 1.6x slower
    than with one thread each (SmolLM2 sharded over 3 ranks, 2-core x86).
    """
    environ = os.environ if environ is None else environ
    ranks = local_ranks(environ)
    if ranks < 2 or environ.get("OPENBLAS_NUM_THREADS"):
        return None
    return max(1, (os.cpu_count() or 1) // ranks)


@dataclass(frozen=True)
class InUse:
    """The BLAS the process has actually loaded: a short name and the library's path."""

    name: str
    path: Optional[str] = None
    reference: bool = False  # MLX's bundled reference BLAS


def global_provider(symbol: str = "cblas_sgemm") -> Optional[str]:
    """The library that serves ``symbol`` from the process's global scope, if any.

    A preloaded library is in the global scope and wins over the BLAS that mlx's
    ``libmlx.so`` links (loaded locally with it): this is what MLX calls.
    """
    import ctypes

    class DlInfo(ctypes.Structure):
        _fields_ = [("dli_fname", ctypes.c_char_p), ("dli_fbase", ctypes.c_void_p),
                    ("dli_sname", ctypes.c_char_p), ("dli_saddr", ctypes.c_void_p)]

    try:
        process = ctypes.CDLL(None)
        address = ctypes.cast(getattr(process, symbol), ctypes.c_void_p).value
        dladdr = process.dladdr
    except (AttributeError, OSError):
        return None
    dladdr.argtypes = [ctypes.c_void_p, ctypes.POINTER(DlInfo)]
    info = DlInfo()
    if not dladdr(address, ctypes.byref(info)) or not info.dli_fname:
        return None
    return os.fsdecode(info.dli_fname)


def mapped_paths(maps: Optional[str] = None) -> list[str]:
    """Files mapped into this process (``/proc/self/maps``)."""
    if maps is None:
        try:
            maps = Path("/proc/self/maps").read_text()
        except OSError:
            return []
    fields = (line.split(None, 5) for line in maps.splitlines())
    return sorted({f[5].strip() for f in fields if len(f) == 6})


def classify(provider: Optional[str], mapped: list[str]) -> InUse:
    """Name the BLAS MLX calls: the global provider of its BLAS symbols, else the one it links."""
    if provider:
        name = "OpenBLAS" if "openblas" in os.path.realpath(provider).lower() else os.path.basename(provider)
        return InUse(name, provider)
    # Not in the global scope: libmlx.so resolves it from its own dependencies, the wheel's
    # reference BLAS (numpy's vendored OpenBLAS uses renamed symbols and never serves MLX).
    for path in mapped:
        if os.path.basename(path).startswith("libblas") and ".libs/" in path:
            return InUse("reference BLAS bundled with MLX (slow batched float32)", path, reference=True)
    return InUse("unknown")


def in_use() -> InUse:
    """The BLAS MLX's CPU backend runs on in this process (call after importing mlx)."""
    if sys.platform == "darwin":
        return InUse("Accelerate (macOS)")
    return classify(global_provider(), mapped_paths())


def note(cpu_backend: bool, environ=None) -> Optional[str]:
    """One stderr line when MLX's CPU backend runs on the slow reference BLAS, naming the fix."""
    environ = os.environ if environ is None else environ
    if not cpu_backend or not sys.platform.startswith("linux") or _truthy(environ.get(OPT_OUT)):
        return None
    current = in_use()
    if not current.reference:
        return None
    slow = "MLX's CPU backend runs on the reference BLAS bundled in its wheel, many times slower for speculative decoding"
    installed = find_system_openblas()
    if installed:  # installed, but the re-exec did not happen or did not take
        return f"note: {slow}: run with LD_PRELOAD={installed}"
    return f"note: {slow}: `{INSTALL_HINT}` (specdec then preloads it itself)"
