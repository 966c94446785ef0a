"""How forwards compute here: one home for the numerics choices, resolved once per run and handed down.

A GPU compiles kernels per shape and rounds by shape; what a run does about it
is decided here, once, from the options and the device, and every forward that
cares (the engine's verify, the warm-up, a request's opening) reads this object
instead of an option string:

- ``shapes``: verify widths as drafted (``exact``) or rounded up to powers of
  two (``bucketed``, see :mod:`.shapes`); ``auto`` buckets where the device
  compiles per shape. A recurrent target whose rollback records nothing cannot
  cut padding rows out of its recurrence: there ``auto`` falls back to exact and
  an explicit ``bucketed`` is refused (:meth:`Numerics.for_rollback`).
- ``attention``: which attention kernels the device runs (on CUDA, cuDNN's or
  MLX's own: ``MLX_CUDA_USE_CUDNN_SDPA``, set before the first forward by
  :func:`~specdec_cli.model.backend.decode_attention_default`); part of what makes two runs'
  caches interchangeable;
- ``exact``: every target forward computes each row's numbers the same whatever
  shares it (``--exact``: :mod:`specdec_cli.model.exact`).
- ``pipeline``: a single row's block that drafted nothing, whose next block will
  draft nothing either (its drafter says so: :func:`specdec_cli.loop.engine._quiet`),
  queues its next forward before reading its token back, as plain decoding does
  (:mod:`specdec_cli.loop.engine`); a drafter that cannot tell (a draft model, an
  MTP head) queues ahead only while its policy is switched off. The queued forward
  is the one the next block would run: for the same drafts the same forwards, so the
  same numbers pipelined or not (tested on this CPU and the GPU-like backend; not yet
  on a GPU). On where the device computes apart from the host (a GPU). On
  this project's 2-core CPU, where the host is the device, blocks without drafts
  measured 2.7% and 6.6% slower pipelined in two runs (``scripts/block_costs.py``,
  float32, open prompt, median of 5; lookup's blocks 0.1% faster and 5.7% slower;
  docs/GENERATE.md), so it is off there. On an H200 (bf16, the same script, median
  of 3) a block without drafts took 4.92 ms pipelined against 6.02 ms not (a plain
  step 4.42 ms); lookup then queued ahead of blocks that drafted too, and those
  paid a forward of their own (docs/GPU-CHECK.md); asking the drafter first is not
  measured on a GPU. Apple's GPUs: not measured.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace
from typing import Optional

import mlx.core as mx

from ..errors import OptionError
from . import shapes as _shapes
from .shapes import SHAPES, fed, widths


@dataclass(frozen=True)
class Numerics:
    """The numerics a run computes with (see the module docstring).

    Attributes:
        shapes: ``exact`` or ``bucketed``: the verify widths forwards run at.
        requested: What was asked (``auto``, ``exact`` or ``bucketed``).
        attention: The attention kernels' switch as the device reads it (``""``: the device's default).
        exact: Every target forward shape-invariant (``--exact``).
        pipeline: Blocks without drafts queue the next forward before their token is read.
    """

    shapes: str = "exact"
    requested: str = "auto"
    attention: str = ""
    exact: bool = False
    pipeline: bool = False

    @classmethod
    def resolve(cls, shapes: str = "auto", *, compiles: Optional[bool] = None, exact: bool = False) -> "Numerics":
        """The numerics ``shapes`` (and ``exact``) ask for on this device (``auto``: bucketed where it compiles
        per shape)."""
        if shapes not in SHAPES:
            raise ValueError(f"shapes must be one of {SHAPES}")
        resolved = shapes
        if shapes == "auto":
            resolved = "bucketed" if (_shapes.compiles_per_shape() if compiles is None else compiles) else "exact"
        return cls(resolved, shapes, os.environ.get("MLX_CUDA_USE_CUDNN_SDPA", ""), exact, pipeline=apart())

    @property
    def bucketed(self) -> bool:
        return self.shapes == "bucketed"

    def widths(self, max_width: int) -> list[int]:
        """Every forward width a verify of up to ``max_width`` rows runs."""
        return widths(max_width, self.shapes)

    def fed(self, width: int) -> int:
        """Rows a forward of ``width`` real rows runs with (padding rows are ignored and dropped)."""
        return fed(width, self.shapes)

    def for_rollback(self, recurrent: bool, strategy: Optional[str], reason: str = "") -> "Numerics":
        """These numerics for a row that rolls back by ``strategy`` (None: it drafts nothing).

        Raises:
            OptionError: ``bucketed`` asked for on a recurrent target whose rollback records nothing.
        """
        if not (self.bucketed and recurrent and strategy is not None and strategy not in ("capture", "tape")):
            return self
        if self.requested == "bucketed":
            raise OptionError(f"--shapes bucketed on this recurrent model needs --rollback capture or tape "
                              f"(it would {strategy}: {reason}); or use --shapes exact")
        return replace(self, shapes="exact")  # auto: padding rows cannot be cut out of a recurrence that records nothing


def apart() -> bool:
    """Whether MLX's default device computes apart from the host (a GPU), so that work queued ahead overlaps it."""
    return mx.default_device() != mx.cpu


__all__ = ["Numerics", "apart"]
