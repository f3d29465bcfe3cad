"""The training script and its helpers, run by the `deepspeed` launcher as files (deepspeed launch/train.py ...).

Installed, this folder is the package ds_longstraw.launch (pyproject's package-dir mapping): `longstraw demo
--task kv` imports ds_longstraw.launch.train and runs it in its own process, in a checkout or from a wheel.
"""
