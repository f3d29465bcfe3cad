"""Models: building transformers models from shape configs, their per-token state in bytes, LoRA.

modeling.py     transformers models from a shape config (configs/models), the packaged configs' folder
model_shape.py  ModelShape: a model's retained bytes per token and layer kinds, from its config alone
shapes.py       the embedded default shapes of the main job and the benchmarks
lora.py         LoRA / QLoRA policies (peft) whose reference is the same module with adapters off
"""
