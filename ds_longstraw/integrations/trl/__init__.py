"""TRL's GRPOTrainer trained through the transaction (`pip install 'ds_longstraw[trl]'`, TRL 1.16).

    from ds_longstraw.integrations.trl import LongStrawGRPOTrainer   # instead of trl's GRPOTrainer
    trainer = LongStrawGRPOTrainer(model=..., reward_funcs=..., args=GRPOConfig(..., deepspeed="ds.json"), ...)

With a "longstraw" block in the DeepSpeed config (or, without DeepSpeed, `longstraw={...}`), each optimizer step's
generation batch is grouped by prompt and every group runs as one transaction: trainer.py says what changes and
what stays TRL's; settings.py which TRL settings map onto the objective and which are refused; scopes.py how TRL's
per-micro-batch normalisation becomes each member's LossScope; metrics.py TRL's metrics from the transactions.
docs/trl.md is the user's page.
"""

from ds_longstraw.integrations.trl.settings import objective_from_trl
from ds_longstraw.integrations.trl.trainer import LongStrawGRPOTrainer

__all__ = ["LongStrawGRPOTrainer", "objective_from_trl"]
