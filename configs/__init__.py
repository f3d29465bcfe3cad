"""The shape configs (models/), run configs (run/) and DeepSpeed configs (deepspeed/), as files.

Installed, this folder is the package ds_longstraw.configs (pyproject's package-dir mapping), so code finds a
built-in config with importlib.resources.files("ds_longstraw.configs") whether it runs from a checkout or from an
installed wheel. Nothing here is imported as code.
"""
