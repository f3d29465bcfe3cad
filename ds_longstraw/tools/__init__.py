"""What a user runs around the transaction: the command line, the planner, benchmarks and data.

cli.py        the `longstraw` command (plan, demo, bench, export)
planner.py    longstraw plan: what fits where, and the predicted seconds per phase
cp_time.py    the time model behind the planner's context-parallel table
bench.py      the demo and benchmark steps against the conventional baselines
baselines.py  the conventional and per-member GRPO steps the transaction is measured against
data.py       prompt and response datasets for the launcher
console.py    progress and table printing
"""
