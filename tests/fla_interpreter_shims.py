"""Runs flash-linear-attention's chunk gated delta rule under the Triton interpreter (CPU tensors), for
tests/unit/test_fla_interpreter.py, in a subprocess of its own.

Run as `TRITON_INTERPRET=1 PYTHONPATH=<folder with fla> python fla_interpreter_shims.py INPUTS OUTPUTS`: INPUTS is a
torch.save'd dict: "cases" (dicts of float32 inputs, cotangents and flags) and "dqkwg" (keyword arguments of fla's
`chunk_bwd_dqkwg`). For each case the project's CUDA glue `kernels/gated_delta/fla_bridge.chunk_gated_delta_rule_fla`
calls fla, twice: as installed, and with the project's torch `chunk_bwd_dqkwg` (kernels/gated_delta/fla_dqkwg.py)
registered and taken, as where fla refuses its own. OUTPUTS receives the output, the final state and the gradients of
every input (the initial state's included) under those cotangents, for both; and for each "dqkwg" entry, fla's
Triton step and the torch one on the same arguments.

Never import this module into the test process: fla must not be importable there (transformers' qwen3_5 then
sends CPU tensors to fla), and the shims below change Triton for the whole process.

fla 0.6.0 imports cleanly without a GPU: its device queries (fla/utils/hardware.py: `triton.runtime.driver.active`,
`torch.cuda.get_device_capability`) sit behind try/except or behind `IS_NVIDIA`, which is false here, and it warns
"Triton is not supported on current platform, roll back to CPU". Two things fail at the first launch, and one shim
each fixes them (both touch Triton, not fla):

1. Autotuning. fla's kernels are `triton.autotune`d (fla/ops/utils/cache.py: `CachedAutotuner`, a subclass of
   Triton's `Autotuner`). With more than one config, `Autotuner.run` times each through
   `triton.runtime.driver.active.get_benchmarker()`, and the interpreter has no driver: "RuntimeError: 0 active
   drivers ([]). There should only be one." (Triton's on-disk tuning cache, which fla turns on through
   `FLA_CACHE_RESULTS`, asks the driver for its target as well.) Shim: `Autotuner.prune_configs` keeps only the
   first config that survives fla's own pruning; with a single config Triton neither times nor caches. Block sizes
   stay those of a real config; warps and stages mean nothing to the interpreter.
2. Loop indices. Compiled Triton makes the index of `for i in range(n)` (and `tl.range`) a tensor; the interpreter
   runs the loop in Python, so the index is a Python int and fla's `i_t.to(tl.int64)`
   (fla/ops/common/chunk_delta_h.py) raises "AttributeError: 'int' object has no attribute 'to'". Shim: the
   interpreter's source rewriter (`FunctionRewriter.ast_transformer`, which already turns every assignment's value
   into a tensor) also rebinds such a loop's index to a tensor at the top of the body. `tl.static_range` loops
   keep their Python ints, as their indices are compile-time constants when compiled.

Both reach into Triton internals (triton.runtime.autotuner.Autotuner.prune_configs,
triton.runtime.interpreter.ASTTransformer / FunctionRewriter; checked with Triton 3.9) and are installed before
the first kernel runs (the interpreter caches each kernel's rewritten source).
"""

import ast
import os
import sys
import warnings


def _runtime_range(node) -> bool:
    """`range(...)` or `tl.range(...)` (any module alias), not `tl.static_range(...)`."""
    if not isinstance(node, ast.Call):
        return False
    if isinstance(node.func, ast.Name):
        return node.func.id == "range"
    return isinstance(node.func, ast.Attribute) and node.func.attr == "range"


def install() -> None:
    """Apply both shims (module docstring) to this process's Triton. Only under the interpreter."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        raise RuntimeError("the shims are for the Triton interpreter: set TRITON_INTERPRET=1 before importing triton")
    from triton.runtime import autotuner, interpreter

    prune = autotuner.Autotuner.prune_configs

    def first_config(self, kwargs):  # shim 1
        return prune(self, kwargs)[:1]

    autotuner.Autotuner.prune_configs = first_config

    class _TensorLoopIndex(interpreter.ASTTransformer):  # shim 2
        def visit_For(self, node):
            node = self.generic_visit(node)
            if isinstance(node.target, ast.Name) and _runtime_range(node.iter):
                name = node.target.id
                # `name = interpreter_semantic.to_tensor(name, False)`, as the base class rewrites assignments
                to_tensor = ast.Attribute(value=ast.Name(id="interpreter_semantic", ctx=ast.Load()), attr="to_tensor",
                                          ctx=ast.Load())
                rebind = ast.Assign(targets=[ast.Name(id=name, ctx=ast.Store())],
                                    value=ast.Call(func=to_tensor, args=[ast.Name(id=name, ctx=ast.Load()),
                                                                         ast.Constant(value=False)], keywords=[]))
                node.body.insert(0, ast.copy_location(rebind, node))
            return node

    interpreter.FunctionRewriter.ast_transformer = _TensorLoopIndex()


def run_case(case: dict) -> dict:
    """fla's forward and backward on one case (keys as written by tests/unit/test_fla_interpreter.py)."""
    import torch

    from ds_longstraw.kernels.gated_delta.fla_bridge import chunk_gated_delta_rule_fla

    names = ["q", "k", "v", "g", "beta"] + (["h0"] if case["h0"] is not None else [])
    inputs = {name: case[name].clone().requires_grad_() for name in names}
    out, final = chunk_gated_delta_rule_fla(inputs["q"], inputs["k"], inputs["v"], inputs["g"], inputs["beta"],
                                            inputs.get("h0"), output_final_state=True,
                                            use_qk_l2norm_in_kernel=case["l2norm"])
    grads = torch.autograd.grad([out, final], list(inputs.values()), [case["d_out"], case["d_final"]])
    return {"out": out.detach(), "final": final.detach(), **{f"d_{name}": d
                                                             for name, d in zip(names, grads, strict=True)}}


def run_case_with_torch_dqkwg(case: dict) -> tuple[dict, int]:
    """run_case with the project's torch `chunk_bwd_dqkwg` (kernels/gated_delta/fla_dqkwg.py) registered with fla
    and taken on every call, as on a machine where fla refuses its Triton build; and how many calls it served (as
    the dispatch's record counts them). The default registration is restored after."""
    from ds_longstraw.kernels.dispatch import paths_taken, reset_paths_taken
    from ds_longstraw.kernels.gated_delta.fla_dqkwg import register_backend, serves

    served = []

    def accept_every_gated_call(q, k, g, g_gamma, cu_seqlens):
        served.append(g is not None)
        return serves(g, g_gamma, cu_seqlens)

    assert register_backend(accept_every_gated_call)
    reset_paths_taken()
    try:
        results = run_case(case)
        assert paths_taken().get("fla backward step dqkwg") == {"torch": sum(served)}, paths_taken()
        return results, sum(served)
    finally:
        register_backend()


def run_dqkwg(inputs: dict) -> tuple[tuple, tuple]:
    """fla's Triton `chunk_bwd_dqkwg` (its undispatched default) and the project's torch build on the same inputs."""
    import inspect

    from fla.ops.common import chunk_o

    from ds_longstraw.kernels.gated_delta.fla_dqkwg import chunk_bwd_dqkwg_torch

    fla_kernel = inspect.unwrap(chunk_o.chunk_bwd_dqkwg)  # past fla's backend dispatch
    return fla_kernel(**inputs), chunk_bwd_dqkwg_torch(**inputs)


def main(argv) -> None:
    inputs_path, outputs_path = argv
    install()
    import torch

    warnings.filterwarnings("ignore", message="Triton is not supported on current platform")
    inputs = torch.load(inputs_path)
    torch.save({"cases": [run_case(case) for case in inputs["cases"]],
                "torch_dqkwg_cases": [run_case_with_torch_dqkwg(case) for case in inputs["cases"]],
                "dqkwg": [run_dqkwg(step) for step in inputs["dqkwg"]]}, outputs_path)


if __name__ == "__main__":
    main(sys.argv[1:])
