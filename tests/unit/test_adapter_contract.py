"""The adapter contract (arch/contract.py): every registered family's adapter gives what the transaction and its
layers' cross-rank code call, member by member and parameter by parameter; a missing member or changed parameters
are named before any work (adapter_for raises)."""

import pytest
from glm_models import tiny_glm_moe_dsa
from models import tiny_qwen3_5

from ds_longstraw.arch import adapter_for
from ds_longstraw.arch.contract import (
    Adapter,
    DenseAttentionLayers,
    RecurrentScanLayers,
    SparseSelectionLayers,
    check_contract,
    contract_violations,
    contracts_for,
)


@pytest.mark.parametrize("build,contracts", [
    (tiny_qwen3_5, [Adapter, RecurrentScanLayers, DenseAttentionLayers]),  # by combine name: affine_scan, lse
    (tiny_glm_moe_dsa, [Adapter, SparseSelectionLayers]),
], ids=["qwen3_5", "glm_moe_dsa"])
def test_every_family_meets_the_contracts_its_layers_need(build, contracts):
    adapter = adapter_for(build())
    assert contracts_for(adapter.specs) == contracts
    assert contract_violations(adapter) == []
    assert all(isinstance(adapter, contract) for contract in contracts)


def test_a_missing_member_or_other_parameters_are_named():
    """Deliberate violations: a family's adapter without its scan's output size, and one whose attention_scale
    takes another parameter: adapter_for's check names both before any work."""
    adapter = adapter_for(tiny_qwen3_5())

    class Broken(type(adapter)):
        scan_output_bytes = None  # as if the family never wrote it

        def attention_scale(self, layer):  # the contract's parameter is `index`
            return super().attention_scale(layer)

    broken = object.__new__(Broken)
    broken.__dict__.update(adapter.__dict__)
    assert contract_violations(broken) == [
        "RecurrentScanLayers.scan_output_bytes: not a method",
        "DenseAttentionLayers.attention_scale: parameters ['layer'], declared ['index']"]
    with pytest.raises(TypeError, match="Broken does not meet the adapter contract"):
        check_contract(broken)
