"""What specdec knows about the target and the machine: hooks into mlx-lm's models (hidden-state taps,
recurrent mixers stepped for rollback), prompts through the chat template, the bundled model's files,
the backend and BLAS probes, and the ranks under mlx.launch."""
