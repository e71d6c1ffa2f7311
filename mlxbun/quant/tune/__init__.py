"""command=tune: learned rounding, a quantized model tuned end to end to match its reference."""
