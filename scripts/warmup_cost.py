"""What the warm-up costs and what it changes, side by side in one process.

For each prompt and repeat, runs `specdec generate`'s default configuration
(the default drafter and block size, adaptive) through the runner twice, with
and without the warm-up, interleaved, each time forgetting which shapes this
process has run (as a fresh process would). Reports the median total wall
time (prefill + warm-up + decode), decode tok/s and warm-up seconds.

  LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libblas.so.3 \
  python scripts/warmup_cost.py --model ../shared/models/smollm2-135m-instruct-q4 --dtype float32
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

if __name__ == "__main__":
    # Before MLX loads (the dynamic loader reads LD_PRELOAD only at start-up): run again once with
    # the system OpenBLAS preloaded, as the CLI does (SPECDEC_NO_REEXEC=1 turns it off).
    from specdec_cli.model.blas import maybe_reexec

    maybe_reexec()

from specdec_cli.cache import caches  # noqa: E402
from specdec_cli.cli.commands import GenerateOptions, prompt_ids  # noqa: E402
from specdec_cli.session import check_model_options, load_setup, make_policy, resolve_block_size  # noqa: E402
from specdec_cli.loop.events import collect  # noqa: E402
from specdec_cli.loop.runner import run  # noqa: E402

PROMPTS = {
    "summarize": "Summarize in two sentences: The city council met on Tuesday to discuss the new park. The park "
                 "will have a playground, a small lake and walking paths. The council said the park will open next "
                 "spring. Residents asked for more trees and benches.",
    "explain": "Explain in a short paragraph why the sky is blue.",
}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", help="model directory (default: the bundled model)")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    opts = GenerateOptions(model=args.model, dtype=args.dtype, prompt="x")
    kind = check_model_options(opts)
    block = resolve_block_size(None, None, kind)
    setup = load_setup(opts, kind)
    prompts = {name: prompt_ids(setup, text) for name, text in PROMPTS.items()}
    model, eos = setup.target.model, setup.eos_ids
    rows = []
    for name, ids in prompts.items():
        res = {True: [], False: []}
        for _ in range(args.repeats):
            for warm in (True, False):
                caches._RAN.clear()  # as a fresh process
                start = time.perf_counter()
                policy = make_policy(True, block, kind)
                stats, out = collect(run(model, ids, drafter=setup.make_drafter(policy), policy=policy,
                                         max_tokens=args.max_tokens, eos_ids=eos, warmup=warm))
                res[warm].append((time.perf_counter() - start, stats.decode_tps, stats.warmup_s, out,
                                  stats.warmup_rows))
        same = all(r[3] == res[False][0][3] for r in res[True] + res[False])
        med = {w: (statistics.median(r[0] for r in res[w]), statistics.median(r[1] for r in res[w]),
                   statistics.median(r[2] for r in res[w])) for w in res}
        row = {"prompt": name, "tokens": len(res[True][0][3]), "identical_output": same,
               "wall_s_warm": med[True][0], "wall_s_cold": med[False][0],
               "wall_ratio": med[True][0] / med[False][0], "decode_tps_warm": med[True][1],
               "decode_tps_cold": med[False][1], "warmup_s": med[True][2], "warmup_rows": res[True][0][4],
               "wall_s_all": {str(w): [round(r[0], 3) for r in res[w]] for w in res}}
        rows.append(row)
        print(json.dumps(row))


if __name__ == "__main__":
    main()
