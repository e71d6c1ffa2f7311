"""command=rotate: fold a seeded randomized Hadamard rotation into a checkpoint, and check the folded model computes what its source does."""
