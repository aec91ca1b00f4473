"""Measurements on this machine: a proxy step's time, checkpoint costs, and on a GPU the check of
gradients and replayed step times."""
