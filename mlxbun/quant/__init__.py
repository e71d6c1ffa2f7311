"""Quantization, one package per command (quantize/, sensitivity/, allocate/, tune/) over a core:
the vocabulary (spec), plan.json (plan), the model skeleton a plan is applied to, a model loaded to
measure (probe), calibration tokens, Hessians and the command that captures them (calibrate), the
rounding methods (rounding, awq) and mlx-lm as reached from here (mlxlm)."""
