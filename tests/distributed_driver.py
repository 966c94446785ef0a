"""Runs several ``specdec`` commands in one process per rank, under ``mlx.launch`` (tests/model/test_distributed.py).

One launch pays the start-up (imports, the ring's connections) once for many
checks. Usage: ``mlx.launch ... -- python distributed_driver.py SPEC.json``,
where SPEC holds ``{"out": DIR, "runs": [{"name", "args", "rank_args"?}]}``;
``rank_args`` maps a rank (as a string) to the arguments that rank runs
instead, and ``rank_cwd`` the folder it runs in (a relative path, the same on every rank, to files
that differ by machine). Each rank writes ``DIR/rank<N>.json``: per run its exit code, what
it wrote to stdout and stderr, and the tokens every engine run committed on
this rank (so ranks can be compared, though only rank 0 writes text).
"""

import io
import json
import os
import sys
from contextlib import redirect_stderr, redirect_stdout
from pathlib import Path

import mlx.core as mx

from specdec_cli.loop import compare, events, runner
from specdec_cli.session import measure
from specdec_cli.cli.app import app
from specdec_cli.session.generate import Session


def main() -> None:
    spec = json.loads(Path(sys.argv[1]).read_text())
    rank = mx.distributed.init().rank()
    committed: list[list[int]] = []

    def spy(real):
        def spied(*args, **kwargs):
            # Every generation (speculative, plain, --compare-ar's plain side) on this rank.
            tokens: list[int] = []
            committed.append(tokens)
            for event in real(*args, **kwargs):
                if isinstance(event, events.Step):
                    tokens.extend(event.block.tokens)
                yield event
        return spied

    for module in (compare, measure):
        module.run = spy(runner.run)
    Session.generate = spy(Session.generate)
    results = []
    for run in spec["runs"]:
        args = run.get("rank_args", {}).get(str(rank), run["args"])
        committed.clear()
        out, err = io.StringIO(), io.StringIO()
        home = os.getcwd()
        os.chdir(run.get("rank_cwd", {}).get(str(rank), home))
        with redirect_stdout(out), redirect_stderr(err):
            try:
                app(args, prog_name="specdec")
                code = 0
            except SystemExit as e:
                code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        os.chdir(home)
        results.append({"name": run["name"], "code": code, "stdout": out.getvalue(), "stderr": err.getvalue(),
                        "committed": [list(t) for t in committed]})
    Path(spec["out"], f"rank{rank}.json").write_text(json.dumps(results))


if __name__ == "__main__":
    main()
