"""The DeepSpeed side: the engine that runs GRPO groups as transactions, its config, checkpoints and export.

engine.py            initialize and LongstrawEngine: groups -> one reduction and one optimizer step
config.py            the DeepSpeed JSON's "longstraw" block read from the engine's config
experts.py           the expert-parallel slices the engine's ZeRO state does not see
checkpoint_files.py  what a training run writes beside DeepSpeed's checkpoint
run_config.py        the training launcher's run config (omegaconf)
export.py            longstraw export: a checkpoint to a transformers model folder
"""
