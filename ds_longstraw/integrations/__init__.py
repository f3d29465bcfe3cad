"""Other trainers on the transaction: `ds_longstraw.integrations.trl` (TRL's GRPOTrainer).

The top layer of the package: an integration may import anything below it, nothing imports it.
"""
