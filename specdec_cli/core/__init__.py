"""The vocabulary of decoding: what a forward produced (blocks), token choice and acceptance (sampling),
logits processors, draft-length policies, verify shapes and the statistics."""
