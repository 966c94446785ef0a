"""Arrays to safetensors bytes and back, checked: the file format of every cache written to disk.

Written and read with numpy (bfloat16 travels as its 16 bits with the dtype ``BF16``), so
``mx.load`` reads the files too. The header's metadata carries a sha256 of the data: a truncated
or damaged file is :class:`Damaged`, never loaded.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

import mlx.core as mx
import numpy as np

# safetensors dtype names <-> numpy (bfloat16 travels as its uint16 bits).
NP_DTYPES = {
    "F64": np.float64, "F32": np.float32, "F16": np.float16, "BF16": np.uint16,
    "I64": np.int64, "I32": np.int32, "I16": np.int16, "I8": np.int8,
    "U64": np.uint64, "U32": np.uint32, "U16": np.uint16, "U8": np.uint8, "BOOL": np.bool_,
}
MX_TAGS = {
    mx.float32: "F32", mx.float16: "F16", mx.bfloat16: "BF16", mx.int64: "I64", mx.int32: "I32",
    mx.int16: "I16", mx.int8: "I8", mx.uint64: "U64", mx.uint32: "U32", mx.uint16: "U16", mx.uint8: "U8",
    mx.bool_: "BOOL",
}


class Damaged(Exception):
    """A file that must not be loaded (truncated, corrupted, foreign, inconsistent)."""


# --- the file format ----------------------------------------------------------------------------


def to_numpy(a: mx.array) -> tuple[np.ndarray, str]:
    """An evaluated MLX array as a numpy copy and its safetensors dtype."""
    tag = MX_TAGS.get(a.dtype)
    if tag is None:
        raise TypeError(f"no safetensors dtype for {a.dtype}")
    if a.dtype == mx.bfloat16:
        a = a.view(mx.uint16)
    return np.array(a, copy=True), tag


def to_mx(arr: np.ndarray, tag: str) -> mx.array:
    out = mx.array(arr)
    return out.view(mx.bfloat16) if tag == "BF16" else out


def encode(tensors: dict[str, tuple[np.ndarray, str]], meta: dict[str, str]) -> tuple[bytes, list[np.ndarray]]:
    """The header bytes (length prefix included) and the arrays whose bytes follow, in order."""
    header: dict[str, Any] = {}
    digest = hashlib.sha256()
    arrays = []
    offset = 0
    for name, (arr, tag) in tensors.items():
        arr = np.ascontiguousarray(arr)
        if arr.size == 0:
            continue  # not every reader takes empty tensors: the layout says what is absent
        header[name] = {"dtype": tag, "shape": list(arr.shape), "data_offsets": [offset, offset + arr.nbytes]}
        offset += arr.nbytes
        digest.update(memoryview(arr).cast("B"))
        arrays.append(arr)
    header["__metadata__"] = {**meta, "sha256": digest.hexdigest()}
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)  # the data starts 8-byte aligned
    return len(text).to_bytes(8, "little") + text, arrays


def decode(blob: bytes) -> tuple[dict[str, tuple[np.ndarray, str]], dict[str, str]]:
    """Arrays and metadata of a file's bytes, checked against its checksum.

    Raises:
        Damaged: Truncated, not this format, or the data does not match its checksum.
    """
    try:
        if len(blob) < 8:
            raise Damaged("shorter than its header length")
        size = int.from_bytes(blob[:8], "little")
        if size > len(blob) - 8:
            raise Damaged("truncated header")
        header = json.loads(blob[8 : 8 + size])
        meta = header.pop("__metadata__")
        data = memoryview(blob)[8 + size :]
        if hashlib.sha256(data).hexdigest() != meta.get("sha256"):
            raise Damaged("data does not match its checksum")
        out = {}
        for name, spec in header.items():
            dtype = np.dtype(NP_DTYPES[spec["dtype"]])
            start, stop = spec["data_offsets"]
            count = int(np.prod(spec["shape"], dtype=np.int64))
            if not 0 <= start <= stop <= len(data) or stop - start != count * dtype.itemsize:
                raise Damaged(f"tensor {name} lies outside the data")
            arr = np.frombuffer(data, dtype=dtype, count=count, offset=start).reshape(spec["shape"])
            out[name] = (arr, spec["dtype"])
        return out, meta
    except Damaged:
        raise
    except (ValueError, KeyError, TypeError, AttributeError, UnicodeDecodeError) as e:
        raise Damaged(f"unreadable header ({type(e).__name__}: {e})") from None


__all__ = ["Damaged", "decode", "encode", "to_mx", "to_numpy"]
