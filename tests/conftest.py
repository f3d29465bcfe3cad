import os
import sys

# Tiny models gain nothing from intra-op threads, and tests that start several ranks on a 2-core machine
# oversubscribe it (OpenMP spin-waits then slow torch down 10-30x): one thread per process, subprocesses included.
os.environ["OMP_NUM_THREADS"] = "1"
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402

torch.set_num_threads(1)

# Tests import their helpers (tiny models, references) as plain modules from this folder.
sys.path.insert(0, os.path.dirname(__file__))
