"""Token selection from logits."""

from __future__ import annotations

import mlx.core as mx


def greedy(logits: mx.array) -> mx.array:
    """Greedy tokens for each row of ``logits``, exactly as mlx-lm picks them.

    mlx-lm takes the argmax of the log-probabilities in the model's dtype; in
    bfloat16 the subtraction rounds near-equal logits into ties that a plain
    argmax of the logits would break differently.
    """
    logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    return mx.argmax(logprobs, axis=-1).astype(mx.uint32)
