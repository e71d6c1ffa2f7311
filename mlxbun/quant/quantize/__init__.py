"""command=quantize: the streaming conversion of a checkpoint to a quantized MLX model, and what it writes beside the weights."""
