"""What waits in host memory: the activations' placement and the optimizer state on host."""
