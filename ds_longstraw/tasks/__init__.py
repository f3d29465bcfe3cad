"""Built-in verifiable tasks: prompt generators and reward functions that a `rollout:` block names by import path."""
