"""``specdec doctor``: what a bug report needs, on one screen.

Every probe is guarded: a broken piece is reported, never raised, so doctor
runs (and exits 0) on exactly the installs that need it most.
"""

from __future__ import annotations

import importlib.metadata
import os
import platform
import sys
import urllib.error
import urllib.request
from typing import Optional

from .. import __version__
from ..model import backend, blas, bundled

# MLX's backend builds by their distribution names (mlx-cpu, mlx-cuda-13, mlx-cuda-12 on Linux; mlx-metal on macOS):
# a CUDA install is reported by the build it installed (there is no "mlx-cuda" distribution in MLX 0.32).
PACKAGES = ("mlx", *backend.BACKENDS, "mlx-metal", "mlx-lm", "transformers", "typer", "huggingface-hub", "rich")
HUB_TIMEOUT_S = 2.0


def _version(dist: str) -> Optional[str]:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def mlx_info() -> dict:
    """MLX's version, default device and backend (CPU / Metal / CUDA), with the GPU's name."""
    try:
        import mlx.core as mx
    except Exception as e:  # a broken mlx install is what doctor is for
        return {"version": None, "error": f"cannot import mlx.core: {type(e).__name__}: {e}"}
    info: dict = {"version": mx.__version__, "device": mx.default_device().type.name}
    backend = "CPU"
    try:
        if mx.metal.is_available():
            backend = "Metal"
        elif hasattr(mx, "cuda") and mx.cuda.is_available():
            backend = "CUDA"
    except Exception:
        pass
    info["backend"] = backend
    name = None
    try:
        name = (mx.device_info() or {}).get("device_name")
    except Exception:
        try:
            name = mx.metal.device_info().get("device_name") if backend == "Metal" else None
        except Exception:
            pass
    info["device_name"] = name
    info["dtype_auto"] = "float32" if mx.default_device() == mx.cpu else "checkpoint dtype"
    return info


def blas_info(environ=None) -> dict:
    """The BLAS this process runs on (Linux; mlx must be imported first) and how it got there."""
    environ = os.environ if environ is None else environ
    current = blas.in_use()
    p = blas.probe(environ)
    if p.reexeced:
        how = f"preloaded by specdec (re-executed with LD_PRELOAD; {blas.OPT_OUT}=1 turns that off)"
    elif p.opted_out:
        how = f"{blas.OPT_OUT} is set: no preload by specdec"
    elif p.ld_preload:
        how = "LD_PRELOAD set by the user"
    else:
        how = "as loaded by mlx"
    return {
        "in_use": current.name,
        "path": current.path,
        "how": how,
        "mlx_bundled_reference_blas": p.bundled_blas,
        "system_openblas": p.system_openblas,
        "ld_preload": environ.get("LD_PRELOAD") or None,
    }


def hub_reachable(endpoint: str, timeout: float = HUB_TIMEOUT_S) -> tuple[bool, str]:
    """Whether the Hub answers within ``timeout`` seconds (any HTTP status counts)."""
    try:
        with urllib.request.urlopen(urllib.request.Request(endpoint, method="HEAD"), timeout=timeout) as r:
            return True, f"HTTP {r.status}"
    except urllib.error.HTTPError as e:
        return True, f"HTTP {e.code}"
    except Exception as e:  # DNS, refused, timeout, TLS: all mean "cannot download"
        reason = getattr(e, "reason", e)
        return False, f"{type(e).__name__}: {reason}"


def hub_info(check: bool = True) -> dict:
    """The Hub endpoint, cache directory, offline mode and reachability."""
    try:
        from huggingface_hub import constants
    except Exception as e:
        return {"error": f"cannot import huggingface_hub: {type(e).__name__}: {e}"}
    info = {"endpoint": constants.ENDPOINT, "cache_dir": str(constants.HF_HUB_CACHE),
            "offline": bool(constants.HF_HUB_OFFLINE)}
    if info["offline"]:
        info["reachable"], info["detail"] = None, "not checked (HF_HUB_OFFLINE is set)"
    elif not check:
        info["reachable"], info["detail"] = None, "not checked"
    else:
        info["reachable"], info["detail"] = hub_reachable(constants.ENDPOINT)
    return info


def model_info() -> dict:
    """The bundled default model: where, present, and every file's size and SHA-256."""
    try:
        path = bundled.model_dir()
    except Exception as e:
        return {"name": bundled.DISPLAY_NAME, "path": None, "present": False, "intact": False,
                "problems": [f"{type(e).__name__}: {e}"]}
    checks = bundled.check_files(path, full=True)
    problems = [
        f"{c.name}: " + ("missing" if not c.present else "wrong size" if not c.size_ok else "SHA-256 differs")
        for c in checks if not c.ok
    ]
    info = {
        "name": bundled.DISPLAY_NAME,
        "path": str(path),
        "present": any(c.present for c in checks),
        "intact": not problems,
        "size_mb": round(sum(size for size, _ in bundled.FILES.values()) / 2**20, 1),
        "problems": problems,
    }
    return info


def collect(check_hub: bool = True) -> dict:
    """Everything doctor reports, as one JSON-ready dict."""
    report: dict = {
        "specdec": __version__,
        "platform": platform.platform(),
        "machine": platform.machine(),
        "python": {"version": platform.python_version(), "executable": sys.executable},
        "mlx": mlx_info(),  # imports mlx, so blas_info sees the libraries it loaded
    }
    if sys.platform.startswith("linux"):
        report["blas"] = blas_info()
    report["packages"] = {name: _version(name) for name in PACKAGES}
    report["hub"] = hub_info(check_hub)
    report["default_model"] = model_info()
    report["notes"] = notes(report)
    return report


def notes(report: dict) -> list[str]:
    """What to fix, one line each."""
    out = []
    # The start-up warning (a GPU build installed but the CPU library in place, ...) goes to stderr; here it is
    # in the report too, so that doctor --json carries it.
    problem, _ = backend.backend_problem()
    if problem:
        out.append(problem)
    if report["mlx"].get("error"):
        out.append(f"{report['mlx']['error']}: reinstall with `python3 -m pip install --force-reinstall mlx`")
    b = report.get("blas")
    if b and report["mlx"].get("backend") == "CPU" and "reference" in b["in_use"]:
        if b["system_openblas"]:
            out.append(f"MLX runs on its slow bundled reference BLAS: run with LD_PRELOAD={b['system_openblas']}"
                       f" (or unset {blas.OPT_OUT})")
        else:
            out.append(f"MLX runs on its slow bundled reference BLAS: `{blas.INSTALL_HINT}`")
    m = report["default_model"]
    if not m["intact"]:
        out.append(bundled.broken_message("; ".join(m["problems"])))
    return out


def lines(report: dict) -> list[str]:
    """The report as aligned ``key: value`` lines."""
    mlx = report["mlx"]
    if mlx.get("error"):
        mlx_line = mlx["error"]
    else:
        device = mlx["backend"] + (f" ({mlx['device_name']})" if mlx.get("device_name") else "")
        mlx_line = f"{mlx['version']}, default device {mlx['device']}: {device}; --dtype auto: {mlx['dtype_auto']}"
    rows = [
        ("specdec", report["specdec"]),
        ("platform", f"{report['platform']} ({report['machine']})"),
        ("python", f"{report['python']['version']} ({report['python']['executable']})"),
        ("mlx", mlx_line),
    ]
    if "blas" in report:
        b = report["blas"]
        rows.append(("blas", f"{b['in_use']}" + (f" [{b['path']}]" if b["path"] else "") + f"; {b['how']}"))
        rows.append(("system openblas", b["system_openblas"] or f"none found (`{blas.INSTALL_HINT}`)"))
    rows.append(("packages", ", ".join(f"{k} {v}" for k, v in report["packages"].items() if v)))
    hub = report["hub"]
    if hub.get("error"):
        rows.append(("hub", hub["error"]))
    else:
        if hub["reachable"] is None:
            rows.append(("hub", f"{hub['endpoint']}: {hub['detail']}"))
        else:
            reach = "reachable" if hub["reachable"] else "unreachable"
            rows.append(("hub", f"{hub['endpoint']}: {reach} ({hub['detail']})"))
        rows.append(("hub cache", hub["cache_dir"]))
    m = report["default_model"]
    state = "intact (sizes and SHA-256 verified)" if m["intact"] else "DAMAGED: " + "; ".join(m["problems"])
    rows.append(("default model", f"{m['name']}, {state} [{m['path']}]"))
    width = max(len(k) for k, _ in rows)
    out = [f"{k:<{width}}  {v}" for k, v in rows]
    out += [f"note: {n}" for n in report["notes"]]
    return out
