"""What the user sees: third-party notices that say nothing about the user's run are kept out of view.

Each entry is one library's message, matched by the logger or module that emits it AND its text, so that nothing
else of that library, and nothing of ds_longstraw, is hidden. Set LONGSTRAW_THIRD_PARTY_WARNINGS=1 to see them all.

  torch.distributed   FutureWarning "`torch.distributed.all_gather_into_tensor` is deprecated" (and
                      reduce_scatter_tensor): DeepSpeed 0.19.8 calls these collectives; nothing a user can change.
  transformers        "`causal_conv1d_fn` / `chunk_gated_delta_rule` is falling back to its reference PyTorch
                      implementation ... much slower": transformers' own Gated DeltaNet path. ds_longstraw's capture,
                      replay and prefix pass run the project's convolution and chunked delta rule instead
                      (ds_longstraw/arch/, kernels/gated_delta/chunked.py); transformers' path is taken only by plain
                      forwards (the conventional baseline, a model loaded from an export).
  transformers        FutureWarning "`is_gradient_checkpointing` is deprecated": peft calls the old name.
  bitsandbytes        "Failed to load CPU gemm_4bit_forward from kernels-community": an optional download-on-demand
                      kernel for CPU inference; bitsandbytes falls back to its built-in one (no hub access here).
"""

import logging
import os
import re
import warnings

SHOW = "LONGSTRAW_THIRD_PARTY_WARNINGS"

# (category, module regex, message regex) for the warnings module
WARNINGS = (
    (FutureWarning, r"torch\.distributed\.", r"`torch\.distributed\.\w+` is deprecated"),
    (FutureWarning, r"transformers\.", r"`is_gradient_checkpointing` is deprecated"),
)
# logger name -> message regex for the logging module
LOG_RECORDS = {
    "transformers.integrations.hub_kernels": r"`\w+` is falling back to its reference PyTorch implementation",
    "bitsandbytes.backends.cpu.ops": r"Failed to load CPU gemm_4bit_forward from kernels-community",
}


class _DropMatching(logging.Filter):
    def __init__(self, pattern):
        super().__init__()
        self.pattern = re.compile(pattern)

    def filter(self, record):
        return not self.pattern.search(record.getMessage())


def third_party_shown() -> bool:
    return os.environ.get(SHOW, "") not in ("", "0")


def hide_third_party_notices():
    """Install the filters above (idempotent; nothing when LONGSTRAW_THIRD_PARTY_WARNINGS=1). Call it early: the
    bitsandbytes notice is emitted when bitsandbytes is first imported."""
    if third_party_shown():
        return
    for category, module, message in WARNINGS:
        warnings.filterwarnings("ignore", message=message, category=category, module=module)
    for name, pattern in LOG_RECORDS.items():
        logger = logging.getLogger(name)
        if not any(isinstance(f, _DropMatching) for f in logger.filters):
            logger.addFilter(_DropMatching(pattern))
