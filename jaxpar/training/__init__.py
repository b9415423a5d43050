"""The training step and what it carries: the trainer (layout, sharded state, the jitted step),
the optimizer, checkpoints, and the metrics a step reports."""
