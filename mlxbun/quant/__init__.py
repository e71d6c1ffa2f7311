"""Quantization: streaming conversion, per-layer plans, sensitivity and bit allocation."""
