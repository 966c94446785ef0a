"""The target's caches: one row's layout and many rows', rollback and the choice of its strategy,
the context and memory limits."""
