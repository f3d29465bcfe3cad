import os
import sys

# Tests import their helpers (tiny models, references) as plain modules from this folder.
sys.path.insert(0, os.path.dirname(__file__))
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
