"""Training: plan, launch, loop, metrics and checkpoints for `gpipe train`."""
