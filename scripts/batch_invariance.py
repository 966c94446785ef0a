"""Which operations give a T-row verify other bits than T one-row decode steps, on this backend.

For each op and dtype: are the T-row results bit-identical to the T one-row
results (T = 2..16), the largest difference, and the time of one T-row call
against T one-row calls, and of ``--exact``'s replacements (its linear and
its attention). Then the same for whole models, with and without ``--exact``:
the logits of a T-row forward against T one-token forwards over the same cache. And ``--exact``'s
operations (and the norm and RoPE between them), a row in a batch against the row alone, and its load
probe on the whole model: what differs where the probe refuses.

  python scripts/batch_invariance.py [--model DIR] [--json OUT]
  LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libblas.so.3 python scripts/batch_invariance.py
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

if __name__ == "__main__":
    # Before MLX loads (the dynamic loader reads LD_PRELOAD only at start-up): run again once with
    # the system OpenBLAS preloaded, as the CLI does (SPECDEC_NO_REEXEC=1 turns it off).
    from specdec_cli.model.blas import maybe_reexec

    maybe_reexec()

import mlx.core as mx  # noqa: E402
import mlx.nn as nn  # noqa: E402

TS = (2, 3, 4, 8, 16)


def timed(f, reps=20):
    mx.eval(f())
    start = time.perf_counter()
    for _ in range(reps):
        mx.eval(f())
    return (time.perf_counter() - start) / reps


def rows_vs_one(f, x):
    batched = f(x)
    one = mx.concatenate([f(x[i: i + 1]) for i in range(x.shape[0])])
    mx.eval(batched, one)
    same = mx.array_equal(batched, one).item()
    diff = mx.abs(batched.astype(mx.float32) - one.astype(mx.float32)).max().item()
    return same, diff


def ops(dtype, h=576, o=1536):
    """Per-op probes at SmolLM2-135M's sizes (hidden 576, MLP 1536, head dim 64)."""
    dt = getattr(mx, dtype)
    k = mx.random.key(0)
    w = (mx.random.normal((o, h), key=k) / h**0.5).astype(dt)
    wq, s, b = mx.quantize(w, group_size=64, bits=4)
    nw = mx.ones((h,), dtype=dt)
    lnb = mx.zeros((h,), dtype=dt)
    out = {}
    table = {
        "matmul": lambda r: r @ w.T,
        "quantized_matmul 4-bit": lambda r: mx.quantized_matmul(r, wq, s, b, transpose=True, group_size=64, bits=4),
        "rms_norm": lambda r: mx.fast.rms_norm(r, nw, 1e-5),
        "layer_norm": lambda r: mx.fast.layer_norm(r, nw, lnb, 1e-5),
        "softmax": lambda r: mx.softmax(r, axis=-1),
        "logsumexp": lambda r: mx.logsumexp(r, axis=-1, keepdims=True),
    }
    for name, f in table.items():
        res = []
        for t in TS:
            x = mx.random.normal((t, h), key=mx.random.split(k, 20)[t]).astype(dt)
            same, diff = rows_vs_one(f, x)
            res.append({"T": t, "same": same, "max_diff": diff})
        x = mx.random.normal((16, h), key=k).astype(dt)
        cost = timed(lambda: f(x)) / (16 * timed(lambda: f(x[:1])))
        out[name] = {"all_same": all(r["same"] for r in res), "max_diff": max(r["max_diff"] for r in res),
                     "rows16_vs_16_one_rows_time": cost}
    out["scaled_dot_product_attention (GQA 9/3, causal)"] = attention_rows_vs_one(
        lambda q, k, v, scale, mask: mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask=mask), dt)
    return out


def attention_rows_vs_one(attend, dt) -> dict:
    """T queries over a cache of 100 + T keys, causal, against one query at a time (``attend(q, k, v, scale,
    mask)``)."""
    heads, d, past = 9, 64, 100
    res = []
    for t in TS:
        k1, k2, k3 = mx.random.split(mx.random.key(t), 3)
        q = mx.random.normal((1, heads, t, d), key=k1).astype(dt)
        kv = [mx.random.normal((1, heads // 3, past + t, d), key=kk).astype(dt) for kk in (k2, k3)]
        batched = attend(q, *kv, d**-0.5, "causal")
        one = mx.concatenate([attend(q[:, :, i: i + 1], kv[0][:, :, : past + i + 1], kv[1][:, :, : past + i + 1],
                                     d**-0.5, None) for i in range(t)], axis=2)
        res.append((mx.array_equal(batched, one).item(),
                    mx.abs(batched.astype(mx.float32) - one.astype(mx.float32)).max().item()))
    return {"all_same": all(s for s, _ in res), "max_diff": max(d for _, d in res)}


def exact_ops(dtype):
    """``--exact``'s replacements (specdec_cli.model.exact): its linear (rows a fixed number at a time) and its
    attention (fixed query matrices, keys folded a fixed block at a time), T rows against one row at a time."""
    from specdec_cli.model import exact

    dt = getattr(mx, dtype)
    k = mx.random.key(1)
    layer = nn.Linear(576, 1536, bias=False)
    layer.update({"weight": layer.weight.astype(dt)})
    layer.__class__ = exact._exact_class(nn.Linear)
    out = {}
    res = []
    for t in TS:
        x = mx.random.normal((t, 576), key=mx.random.split(k, 20)[t]).astype(dt)
        res.append(rows_vs_one(layer, x))
    out["exact linear"] = {"all_same": all(s for s, _ in res), "max_diff": max(d for _, d in res)}
    out["exact attention (GQA 9/3, causal)"] = attention_rows_vs_one(exact.attention, dt)
    return out


def rows_vs_alone(f, x):
    """``f`` over a batch of rows ``[B, ...]`` against each row alone ``[1, ...]``."""
    batched = f(x)
    alone = mx.concatenate([f(x[i: i + 1]) for i in range(x.shape[0])])
    mx.eval(batched, alone)
    return (mx.array_equal(batched, alone).item(),
            mx.abs(batched.astype(mx.float32) - alone.astype(mx.float32)).max().item())


def exact_batch_ops(dtype):
    """``--exact``'s replacements and the ops between them, a row in a batch of 2 or 4 against the row alone
    (its load probe refused on an H200 in bf16: "a row in a batch gives other logits than the same row
    alone"): which op it is."""
    from specdec_cli.model import exact

    dt = getattr(mx, dtype)
    k = mx.random.key(2)
    layer = nn.Linear(576, 1536, bias=False)
    layer.update({"weight": layer.weight.astype(dt)})
    layer.__class__ = exact._exact_class(nn.Linear)
    nw = mx.ones((576,), dtype=dt)
    heads, d, past = 9, 64, 100
    out = {}
    for name, f, shape in (
            ("exact linear", layer, (576,)),
            ("rms_norm", lambda r: mx.fast.rms_norm(r, nw, 1e-5), (576,)),
            ("rope", lambda r: mx.fast.rope(r.reshape(*r.shape[:2], heads, d).swapaxes(1, 2), d, traditional=False,
                                            base=10000.0, scale=1.0, offset=past), (heads * d,))):
        res = []
        for b in (2, 4):
            for t in (1, 3, 16):
                x = mx.random.normal((b, t, *shape), key=mx.random.split(k, 40)[b * 8 + t]).astype(dt)
                res.append(rows_vs_alone(f, x))
        out[name] = {"all_same": all(s for s, _ in res), "max_diff": max(v for _, v in res)}
    res = []
    # 9 query heads over 3 (the bundled model's), and 8 over 2 in a batch of 8: its 64 matrices fill whole calls
    # (exact.MATRICES) where the row alone pads its 8.
    for b, hq, hk in ((2, 9, 3), (4, 9, 3), (8, 8, 2)):
        for t in (1, 3, 16):
            k1, k2, k3 = mx.random.split(mx.random.key(b * 8 + t), 3)
            q = mx.random.normal((b, hq, t, d), key=k1).astype(dt)
            kv = [mx.random.normal((b, hk, past + t, d), key=kk).astype(dt) for kk in (k2, k3)]
            batched = exact.attention(q, *kv, d**-0.5, "causal")
            alone = mx.concatenate([exact.attention(q[i: i + 1], kv[0][i: i + 1], kv[1][i: i + 1], d**-0.5, "causal")
                                    for i in range(b)])
            mx.eval(batched, alone)
            res.append((mx.array_equal(batched, alone).item(),
                        mx.abs(batched.astype(mx.float32) - alone.astype(mx.float32)).max().item()))
    out["exact attention (GQA 9/3, 8/2, causal)"] = {"all_same": all(s for s, _ in res),
                                                     "max_diff": max(v for _, v in res)}
    return out


def model_check(path, dtype, exact_mode=False):
    from specdec_cli.cache.caches import ModelCache
    from specdec_cli.session.loading import load

    model = load(path, None if dtype == "as-shipped" else dtype).model
    if exact_mode:
        from specdec_cli.model import exact

        exact.install(model)
    ids = list(range(1000, 1060))
    res = []
    for t in TS:
        cache = ModelCache(model)
        cache.prefill(ids)
        snap = cache.snapshot()
        x = list(range(2000, 2000 + t))
        batched = cache.feed(mx.array(x, dtype=mx.uint32))
        mx.eval(batched)
        cache.restore(snap)
        one = mx.concatenate([cache.feed(mx.array([v], dtype=mx.uint32)) for v in x])
        mx.eval(one)
        res.append({"T": t, "same": mx.array_equal(batched, one).item(),
                    "max_diff": mx.abs(batched.astype(mx.float32) - one.astype(mx.float32)).max().item()})
    return {"all_same": all(r["same"] for r in res), "max_diff": max(r["max_diff"] for r in res), "by_T": res}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model")
    ap.add_argument("--json")
    args = ap.parse_args()
    report = {"device": str(mx.default_device()), "mlx": mx.__version__,
              "LD_PRELOAD": os.environ.get("LD_PRELOAD", ""), "ops": {}, "models": {}}
    for dtype in ("float32", "bfloat16", "float16"):
        report["ops"][dtype] = ops(dtype)
        for name, r in report["ops"][dtype].items():
            extra = f", 16 rows cost {r['rows16_vs_16_one_rows_time']:.2f}x of 16 one-row calls" \
                if "rows16_vs_16_one_rows_time" in r else ""
            print(f"{dtype:9} {name:48} {'same' if r['all_same'] else 'DIFFERENT'} (max diff {r['max_diff']:.3g}){extra}")
        report["ops"][dtype].update(exact_ops(dtype))
        for name in ("exact linear", "exact attention (GQA 9/3, causal)"):
            r = report["ops"][dtype][name]
            print(f"{dtype:9} {name:48} {'same' if r['all_same'] else 'DIFFERENT'} (max diff {r['max_diff']:.3g})")
        report["batch"] = report.get("batch", {})
        report["batch"][dtype] = exact_batch_ops(dtype)
        for name, r in report["batch"][dtype].items():
            print(f"{dtype:9} {name + ', batch vs alone':48} {'same' if r['all_same'] else 'DIFFERENT'} "
                  f"(max diff {r['max_diff']:.3g})")
    if args.model:
        for dtype in ("float32", "bfloat16", "as-shipped"):
            for exact_mode in (False, True):
                name = dtype + (" --exact" if exact_mode else "")
                r = report["models"][name] = model_check(args.model, dtype, exact_mode)
                print(f"model {name:20} T-row logits vs one-token: {'same' if r['all_same'] else 'DIFFERENT'} "
                      f"(max diff {r['max_diff']:.3g}; same at T = {[x['T'] for x in r['by_T'] if x['same']]})")
                if exact_mode:  # the load probe --exact runs: a batch of two rows against each alone too
                    from specdec_cli.cache.batch_check import exact_problem
                    from specdec_cli.cache.caches import ModelCache
                    from specdec_cli.model import exact
                    from specdec_cli.session.loading import load

                    m = load(args.model, None if dtype == "as-shipped" else dtype).model
                    exact.install(m)
                    problem = exact_problem(m, lambda: ModelCache(m))
                    print(f"model {name:20} --exact's load probe: {problem or 'bit for bit'}")
                    r["exact_probe"] = problem
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
