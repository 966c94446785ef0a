#!/usr/bin/env python
"""Logits processors under speculation: a penalty request and a json_schema request against plain decoding
with the same controls, side by side in one run, and the grammar engine's mask cost per token.

The bundled SmolLM2-135M-Instruct (``--dtype auto``: float32 on a CPU), greedy, prompt lookup (the default
drafter, adaptive); the system OpenBLAS is preloaded when there is one, as ``specdec`` does. Each case runs
speculative and plain decoding alternately, ``--repeats`` times after one untimed run of each:

- copy: a paragraph to copy, no processor (the baseline of the next one);
- copy + penalties: the same with ``repetition_penalty`` 1.1, ``presence_penalty`` 0.3 and
  ``frequency_penalty`` 0.2 (mlx-lm's definitions, 20-token windows);
- json: a record to return as JSON, no processor;
- json + schema: the same under a JSON schema (llguidance grammar).

Per case: decode tok/s of each side (medians), their ratio, whether the texts are identical, and
for the grammar the time llguidance spends per mask (one per verify row) and per emitted token.
Then llguidance's and outlines-core's mask cost per token on a JSON document under a schema, on the
bundled tokenizer (outlines-core only when it is installed: ``pip install outlines-core``).

Usage: python scripts/bench_processors.py [--repeats 3] [--out bench-results/processors.json]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from specdec_cli.model import blas  # noqa: E402

COPY = ("Copy this text exactly: The city council met on Tuesday to discuss the new park. The park will have a "
        "playground, a small lake and walking paths. The council said the park will open next spring, and that "
        "the lake will be stocked with fish for children to watch.")
RECORD = ("Return this record as JSON with the keys city, country, population and founded: the city is Lyon, in "
          "France, with 522250 people, founded in 43 BC. Example of the format: {\"city\": \"Turin\", \"country\": "
          "\"Italy\", \"population\": 848885, \"founded\": \"28 BC\"}")
SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}, "country": {"type": "string"},
                                           "population": {"type": "integer"}, "founded": {"type": "string"}},
          "required": ["city", "country", "population", "founded"], "additionalProperties": False}
PENALTIES = {"repetition_penalty": 1.1, "presence_penalty": 0.3, "frequency_penalty": 0.2}


def mask_costs(tokenizer, hf) -> dict:
    """Mask cost per token of each grammar engine on a JSON document valid against a schema."""
    import numpy as np

    schema = {"type": "object", "properties": {
        "name": {"type": "string"}, "age": {"type": "integer"}, "email": {"type": "string", "format": "email"},
        "tags": {"type": "array", "items": {"type": "string"}},
        "address": {"type": "object", "properties": {"street": {"type": "string"}, "city": {"type": "string"},
                                                     "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                    "required": ["street", "city", "zip"]},
        "active": {"type": "boolean"}, "score": {"type": "number"}},
        "required": ["name", "age", "email", "tags", "address", "active", "score"], "additionalProperties": False}
    doc = json.dumps({"name": "Ada Lovelace", "age": 36, "email": "ada@example.com",
                      "tags": ["math", "poetry", "engines"],
                      "address": {"street": "12 St James's Square", "city": "London", "zip": "12345"},
                      "active": True, "score": 9.75})
    ids = hf.encode(doc, add_special_tokens=False)
    out: dict = {"document_tokens": len(ids), "vocabulary": len(hf)}

    import llguidance
    import llguidance.numpy as lnp

    from specdec_cli.core.processors import JSON_OPTIONS, ll_tokenizer

    t0 = time.perf_counter()
    lltok = ll_tokenizer(tokenizer)
    t1 = time.perf_counter()
    grammar = llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=JSON_OPTIONS)
    matcher = llguidance.LLMatcher(lltok, grammar, log_level=0)
    t2 = time.perf_counter()
    mask = lnp.allocate_token_bitmask(1, lltok.vocab_size)
    times = []
    for _ in range(5):
        matcher.reset()
        for t in ids:
            s = time.perf_counter()
            lnp.fill_next_token_bitmask(matcher, mask, 0)
            times.append(time.perf_counter() - s)
            assert matcher.consume_token(t), matcher.get_error()
    out["llguidance"] = {"version": llguidance.__version__ if hasattr(llguidance, "__version__") else None,
                         "tokenizer_s": t1 - t0, "compile_s": t2 - t1,
                         "mask_us_median": 1e6 * statistics.median(times), "mask_us_mean": 1e6 * statistics.mean(times),
                         "mask_us_max": 1e6 * max(times)}
    try:
        import outlines_core as oc
        from outlines_core.json_schema import build_regex_from_schema
    except ImportError:
        out["outlines_core"] = "not installed"
        return out
    t0 = time.perf_counter()
    vocab: dict = {}
    for tid in range(len(hf)):
        if tid == hf.eos_token_id:
            continue
        vocab.setdefault(hf.convert_tokens_to_string([hf.convert_ids_to_tokens(tid)]), []).append(tid)
    index = oc.Index(build_regex_from_schema(json.dumps(schema)), oc.Vocabulary(hf.eos_token_id, vocab))
    t1 = time.perf_counter()
    guide = oc.Guide(index)
    words = np.zeros(((len(hf) + 31) // 32,), dtype=np.int32)
    times = []
    for _ in range(5):
        guide.reset()
        for t in ids:
            s = time.perf_counter()
            guide.write_mask_into(words.ctypes.data, words.size, 4)
            times.append(time.perf_counter() - s)
            guide.advance(t, False)
    out["outlines_core"] = {"compile_s": t1 - t0, "mask_us_median": 1e6 * statistics.median(times),
                            "mask_us_mean": 1e6 * statistics.mean(times), "mask_us_max": 1e6 * max(times)}
    return out


class Timed:
    """Wraps Grammar._mask_into to time each mask."""

    def __init__(self):
        from specdec_cli.core import processors

        self.seconds, self.masks = 0.0, 0
        real = processors.Grammar._mask_into

        def timed(grammar, masks, i):
            s = time.perf_counter()
            real(grammar, masks, i)
            self.seconds += time.perf_counter() - s
            self.masks += 1

        processors.Grammar._mask_into = timed


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=120)
    ap.add_argument("--out", default=str(ROOT / "bench-results" / "processors.json"))
    args = ap.parse_args()
    blas.maybe_reexec()  # the system OpenBLAS, as specdec itself does

    from specdec_cli.core.processors import Constraint
    from specdec_cli.model.prompts import encode_prompt
    from specdec_cli.session import Request, RunOptions, Session, check_model_options, load_setup
    from specdec_cli.session.options import resolve_block_size

    opts = RunOptions()
    kind = check_model_options(opts)
    setup = load_setup(opts, kind)
    block = setup.run_block_size(resolve_block_size(None, None, kind))
    spec, plain = Session(setup, block, prompt_cache=None), Session(setup, block, prompt_cache=None, plain=True)
    tok = setup.tokenizer
    timer = Timed()
    cases = {
        "copy": (COPY, {}),
        "copy + penalties": (COPY, PENALTIES),
        "json": (RECORD, {}),
        "json + schema": (RECORD, {"constraint": Constraint.json_schema(SCHEMA)}),
    }
    results: dict = {"machine": f"{platform.machine()}, {os.cpu_count()} cores",
                     "blas": os.environ.get("LD_PRELOAD") or "bundled reference BLAS", "model": setup.model_line,
                     "block_size": block, "repeats": args.repeats, "cases": {}}

    def once(session: Session, request: Request) -> tuple[float, list[int], float, int]:
        from specdec_cli.loop.events import Step
        from specdec_cli.core.stats import Stats

        stats, out = Stats(prompt_tokens=len(request.prompt_ids)), []
        seconds, masks = timer.seconds, timer.masks
        for event in session.generate(request):
            if isinstance(event, Step):
                stats.add(event.block, event.seconds)
                out += event.block.tokens
            else:
                stats.note(event)
        return stats.decode_tps, out, timer.seconds - seconds, timer.masks - masks

    for name, (prompt, fields) in cases.items():
        ids = encode_prompt(tok, prompt, None, False, {}, None)
        request = Request(ids, args.max_tokens, **fields)
        once(spec, request), once(plain, request)  # untimed
        rows = {"spec": [], "plain": []}
        texts, mask_s, masks, emitted = set(), 0.0, 0, 0
        for _ in range(args.repeats):
            for side, session in (("spec", spec), ("plain", plain)):
                tps, out, ms, n = once(session, request)
                rows[side].append(tps)
                texts.add((side, tuple(out)))
                if side == "spec":
                    mask_s, masks, emitted = mask_s + ms, masks + n, emitted + len(out)
        spec_tps, plain_tps = statistics.median(rows["spec"]), statistics.median(rows["plain"])
        outs = {t for _, t in texts}
        entry = {"spec_tps": spec_tps, "plain_tps": plain_tps, "ratio": spec_tps / plain_tps,
                 "identical": len(outs) == 1, "tokens": len(next(iter(outs))),
                 "text": tok.decode(list(next(iter(outs))))}
        if masks:
            entry["mask_us_per_row"] = 1e6 * mask_s / masks
            entry["mask_us_per_token"] = 1e6 * mask_s / max(emitted, 1)
        results["cases"][name] = entry
        print(f"{name:18} plain {plain_tps:6.1f} tok/s  spec {spec_tps:6.1f} tok/s  {spec_tps / plain_tps:5.2f}x  "
              f"identical {entry['identical']}  {entry['tokens']} tokens"
              + (f"  mask {entry['mask_us_per_row']:.0f} us/row, {entry['mask_us_per_token']:.0f} us/token"
                 if masks else ""), flush=True)
    results["mask_cost"] = mask_costs(tok, getattr(tok, "_tokenizer", tok))
    print(json.dumps(results["mask_cost"], indent=1))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=1))
    print(f"-> {out}")


if __name__ == "__main__":
    main()
