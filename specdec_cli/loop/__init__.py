"""The draft -> verify -> accept engine over rows, plain decoding (the oracle and the baseline), the
one-sequence runner, the batch planner and --compare-ar's comparison."""
