"""Put a head `specdec distill` wrote into the package as the bundled model's drafter (float16, as shipped).

    python scripts/ship_head.py DIR                     # into specdec_cli/models/smollm2-135m-instruct-mtp/
    python scripts/ship_head.py DIR --model M --dest D  # another target, another folder

Floating-point weights are cast to float16 (half the bytes; a head's drafts are verified by the target, so
output does not change); the draft vocabulary's ids, config.json and training.json are kept, and README.md says it was shipped. The
head is loaded for the target before anything is replaced: one of another model, or not a `specdec_mtp`
sidecar, is refused with a one-line error (exit 2, or 1 for another model's). After it, set ``HEAD_BEATS_LOOKUP`` in
specdec_cli/model/bundled.py from what docs/GPU-CHECK.md's ``headcheck`` measured.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
from pathlib import Path

import mlx.core as mx

from specdec_cli.drafters.mtp_io import SPECDEC_TYPE, load_head
from specdec_cli.errors import OptionError, SpecdecError
from specdec_cli.model import bundled
from specdec_cli.model.files import read_config
from specdec_cli.model.taps import target_parts
from specdec_cli.session import ModelOptions, load_target

KEPT = ("config.json", "README.md", "training.json")
# Appended to the head's README (its training record, training.json, keeps the size training wrote).
SHIPPED = ("Shipped inside specdec-cli as the bundled model's head, its weights stored in float16 ({mib:.1f} MiB; "
           "cast to the target's dtype at load) by scripts/ship_head.py.\n")


def ship(head: Path, model: str | None, dest: Path) -> Path:
    """Write ``head`` with float16 weights to ``dest`` (replaced whole), once it loads for ``model``."""
    config = read_config(head) if (head / "config.json").is_file() else {}
    if config.get("model_type") != SPECDEC_TYPE:
        raise OptionError(f"{head} holds no head specdec distill wrote (no config.json naming {SPECDEC_TYPE}): "
                          "give the folder distill --out wrote")
    weights = mx.load(str(head / "model.safetensors"))
    half = {k: v.astype(mx.float16) if mx.issubdtype(v.dtype, mx.floating) else v for k, v in weights.items()}
    target = load_target(ModelOptions(model=model, dtype="float32"))
    with tempfile.TemporaryDirectory(dir=dest.parent) as tmp:
        staged = Path(tmp) / dest.name
        staged.mkdir()
        mx.save_safetensors(str(staged / "model.safetensors"), half, metadata={"format": "mlx"})
        for name in KEPT:
            if (head / name).is_file():
                shutil.copy2(head / name, staged / name)
        load_head(staged, read_config(staged), str(head), target_parts(target.model))  # refuses another model's
        readme = staged / "README.md"
        if readme.is_file():
            size = (staged / "model.safetensors").stat().st_size
            readme.write_text(readme.read_text().rstrip("\n") + "\n\n" + SHIPPED.format(mib=size / 2**20))
        shutil.rmtree(dest, ignore_errors=True)
        staged.rename(dest)
    return dest


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("head", type=Path, help="the folder specdec distill --out wrote")
    parser.add_argument("--model", default=None, help="the head's target (default: the bundled model)")
    parser.add_argument("--dest", type=Path, default=None,
                        help=f"where it goes (default: specdec_cli/models/{bundled.HEAD_NAME})")
    args = parser.parse_args(argv)
    dest = args.dest or bundled.model_dir().parent / bundled.HEAD_NAME
    try:
        out = ship(args.head, args.model, dest)
    except SpecdecError as e:
        print(f"error: {e}", file=sys.stderr)
        return e.exit_code
    size = (out / "model.safetensors").stat().st_size
    print(f"wrote {out} (float16 weights, {size / 2**20:.1f} MiB)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
