"""The training script and its helpers, run by the `deepspeed` launcher as files (deepspeed launch/train.py ...).

Installed, this folder is the package ds_longstraw.launch (pyproject's package-dir mapping): `longstraw demo
--task recall` imports ds_longstraw.launch.train's helpers and runs them, in a checkout or from a wheel.
"""
