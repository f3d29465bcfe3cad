"""Reward functions that rank processes import by name ("rewards:mod3_reward"): tests/ is on their path, where the
test modules' folders are not."""


def mod3_reward(prompt_ids, response_ids):
    return float(response_ids[0] % 3)
