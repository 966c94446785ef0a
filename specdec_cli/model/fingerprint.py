"""What identifies a model directory's files: for the ranks' handshake and for keys of caches kept on disk."""

from __future__ import annotations

import hashlib
from pathlib import Path

# Text files whose bytes shape the model, its tokenizer or its chat template.
_TEXT = (".json", ".jinja", ".model", ".txt", ".tiktoken", ".py")
# Weight bytes read per file by content_fingerprint: this many windows of this many bytes, evenly spaced.
_SAMPLES, _WINDOW = 16, 1 << 16


def model_fingerprint(path) -> bytes:
    """What identifies a model directory across machines: its config, tokenizer files and weight headers."""
    h = hashlib.sha256()
    for file in sorted(Path(path).iterdir()):
        if not file.is_file():
            continue
        h.update(file.name.encode())
        if file.suffix == ".safetensors":
            # Names, shapes and dtypes (the header) and the size: not gigabytes of weights.
            with open(file, "rb") as f:
                head = f.read(8)
                n = int.from_bytes(head, "little") if len(head) == 8 else 0
                h.update(head + f.read(min(n, 1 << 24)))
            h.update(str(file.stat().st_size).encode())
        elif file.suffix in _TEXT:
            h.update(file.read_bytes())
    return h.digest()


def _samples(h, file: Path, size: int) -> None:
    with open(file, "rb") as f:
        for i in range(_SAMPLES):
            f.seek(max(0, size - _WINDOW) * i // max(1, _SAMPLES - 1))
            h.update(f.read(_WINDOW))


def ranks_fingerprint(path) -> bytes:
    """:func:`model_fingerprint` plus samples of every weight file's bytes: what ranks on several machines compare.

    Two revisions or fine-tunes of one model have the same headers and sizes: sharded together, each
    rank's shard came from another model and the text was neither's. Windows (1 MiB a file) see a full
    fine-tune; modification times, which content_fingerprint adds, differ between machines' copies.
    """
    h = hashlib.sha256(model_fingerprint(path))
    for file in sorted(Path(path).glob("*.safetensors")):
        _samples(h, file, file.stat().st_size)
    return h.digest()


def content_fingerprint(path) -> str:
    """:func:`model_fingerprint` plus every weight file's modification time and samples of its bytes, as hex.

    Two fine-tunes of one architecture have the same headers and sizes. A full
    fine-tune differs everywhere, which evenly spaced windows see without reading
    gigabytes; a fused LoRA or new scales change a few layers only, which windows
    may miss, but the weights were written anew: their modification time
    differs. Caches computed by one model must never resume on another (a copy
    that does not keep the times is only a miss).
    """
    h = hashlib.sha256(model_fingerprint(path))
    for file in sorted(Path(path).glob("*.safetensors")):
        st = file.stat()
        size = st.st_size
        h.update(f"{file.name}:{size}:{st.st_mtime_ns}".encode())
        _samples(h, file, size)
    return h.hexdigest()
