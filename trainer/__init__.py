"""Training: the loop, its schedule and optimizer, checkpoints, logging."""
