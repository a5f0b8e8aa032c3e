"""Train state, step and loop."""
