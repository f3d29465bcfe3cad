"""Rollouts decoded from the captured prompt state, and the on-policy step that trains on them.

generate.py        generate: G samples of one prompt from one capture (Rollouts, the kept capture)
environment.py     multi-turn samples: an environment's observations captured between a sample's actions
step.py            one rollout-and-train step over several prompts (rewards, groups, the engine's step)
decode_lockstep.py the padding that pairs ranks' decode calls under ZeRO-3 and expert parallelism
"""
