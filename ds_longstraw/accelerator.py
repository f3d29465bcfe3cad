"""Tell DeepSpeed the accelerator where there is none to find: DS_ACCELERATOR=cpu when no device is visible.

Without DS_ACCELERATOR, DeepSpeed probes for XPU, NPU, MPS, HPU, ... and CUDA devices at import and, finding none,
warns "Setting accelerator to CPU. If you have GPU or other accelerator, we were unable to detect it." in every
process (launcher, each rank). Where the same probes find nothing, "cpu" is the answer DeepSpeed would reach:
saying it changes nothing but the message. Where a device is visible, or DS_ACCELERATOR is set, nothing is touched.

Used before anything imports deepspeed (so it imports neither deepspeed nor the rest of ds_longstraw):
    ds_longstraw/__init__.py   settle() first thing, so `import ds_longstraw` (the `longstraw` command, a user's
                               script) does not make DeepSpeed guess
    launch/train.py            settle() at the top (each rank decides for its own machine)
    bin/main, launch/quickstart.sh
                               `python ds_longstraw/accelerator.py` exits 0 when no device is visible (then they
                               export DS_ACCELERATOR=cpu for the local processes they start)
"""

import importlib.util
import os
import sys
from collections.abc import MutableMapping

# Plug-in packages DeepSpeed's probe imports (deepspeed/accelerator/real_accelerator.py, 0.19.8): present means
# "let DeepSpeed decide".
PLUGINS = ("torch_npu", "torch_sdaa", "habana_frameworks", "torch_mlu", "torch_supa", "torch_xmlir")


def device_visible() -> bool:
    """True when DeepSpeed's probe could find an accelerator here (CUDA/ROCm, XPU, MPS, or a plug-in package)."""
    import torch

    if torch.cuda.is_available() and torch.cuda.device_count() > 0:
        return True
    if hasattr(torch, "xpu") and torch.xpu.is_available():
        return True
    if torch.backends.mps.is_available():
        return True
    return any(importlib.util.find_spec(name) is not None for name in PLUGINS)


def settle(environ: MutableMapping[str, str] = os.environ) -> str | None:
    """Set DS_ACCELERATOR=cpu in `environ` when it is unset and no device is visible; returns its value."""
    if "DS_ACCELERATOR" not in environ and not device_visible():
        environ["DS_ACCELERATOR"] = "cpu"
    return environ.get("DS_ACCELERATOR")


if __name__ == "__main__":
    sys.exit(1 if device_visible() else 0)
