"""specdec-cli: lossless speculative decoding for MLX / mlx-lm."""

__version__ = "0.1.0"
