"""The package's shape, checked from its source (no imports run):

  - no import cycle anywhere in ds_longstraw (function-level imports included): the module graph of every
    `import` / `from ... import` statement, has no cycle;
  - the rooms are layered (LAYERS): no module imports one of a higher layer (the root's door, ds_longstraw's
    __init__, imports every room; the root's plain modules - config, group, objective, seeds, sizes - none);
  - offload/ and kernels/ import nothing of ds_longstraw outside themselves (pages, tiers and kernels do not depend
    on the engine: the planner's generic cost model takes a ModelShape, built elsewhere from the specs);
  - no module but arch/specs.py (the rules' registry) compares a layer's combine rule with a string: the rest ask
    the registry (arch/specs.CombineRule's facts, grpo/cp/kinds/ for the cross-rank code);
  - no private name (one leading underscore) is imported across packages;
  - only ds_longstraw/arch/ (and kernels/) names a model family's modules, attributes or layer kinds: the
    transaction, the topologies, the state and the offload tiers read the adapter's layer-state specs;
  - pyproject's package list names every folder of the package and its package-dir mapping is the one here (a
    folder left out is missing from the wheel; test_packaging.py installs one);
  - the tree is clean under the ruff configuration in pyproject.toml (when ruff is installed).
"""

import ast
import io
import os
import shutil
import subprocess
import sys
import tokenize

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# installed package name -> folder in the checkout (pyproject's package-dir mapping)
PACKAGES = {"ds_longstraw": "ds_longstraw", "ds_longstraw.configs": "configs", "ds_longstraw.launch": "launch"}


def _modules():
    """module name -> (path, is_package) for every .py file of the package."""
    found = {}
    for package, folder in PACKAGES.items():
        base = os.path.join(ROOT, folder)
        for dirpath, dirnames, filenames in os.walk(base):
            dirnames[:] = [d for d in dirnames if d != "__pycache__" and os.path.join(dirpath, d) not in
                           {os.path.join(ROOT, f) for f in PACKAGES.values()}]
            rel = os.path.relpath(dirpath, base)
            prefix = package if rel == "." else package + "." + rel.replace(os.sep, ".")
            for name in filenames:
                if name.endswith(".py"):
                    module = prefix if name == "__init__.py" else f"{prefix}.{name[:-3]}"
                    found[module] = (os.path.join(dirpath, name), name == "__init__.py")
    return found


def _edges(modules):
    """module -> set of modules of the package it imports (anywhere in the file)."""
    edges = {}
    for module, (path, is_package) in modules.items():
        package = module if is_package else module.rpartition(".")[0]
        with open(path) as handle:
            tree = ast.parse(handle.read(), path)
        targets = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                targets.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package.split(".")
                    base = base[: len(base) - (node.level - 1)]
                    source = ".".join(base + ([node.module] if node.module else []))
                else:
                    source = node.module
                for alias in node.names:  # `from pkg import module` imports that module
                    targets.add(f"{source}.{alias.name}" if f"{source}.{alias.name}" in modules else source)
        edges[module] = {t for t in targets if t in modules and t != module}
    return edges


def _cycles(edges):
    """Strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on_stack, out, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in edges[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return out


def test_no_import_cycles():
    modules = _modules()
    assert "ds_longstraw.grpo.transaction" in modules and "ds_longstraw.offload.pages" in modules
    assert _cycles(_edges(modules)) == []


def test_pyproject_ships_every_package():
    """pyproject's explicit package list names every folder of the package that holds Python files, and its
    package-dir mapping is the one above: a folder left out installs from a checkout (editable) but is missing from
    the wheel (test_packaging.py builds one)."""
    tomllib = pytest.importorskip("tomllib")
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as handle:
        setuptools = tomllib.load(handle)["tool"]["setuptools"]
    assert {"ds_longstraw": "ds_longstraw", **setuptools["package-dir"]} == PACKAGES
    packages = {module if is_package else module.rpartition(".")[0]
                for module, (_, is_package) in _modules().items()}
    assert set(setuptools["packages"]) == packages


# The rooms, lowest first: a module may import its own layer and those below, never one above (a module belongs to
# its longest prefix here). The root's plain modules are the base every room may read; its __init__ (the user's
# door) sits above every room, with the launcher's script; the command line above all.
LAYERS = [
    ("base", ["ds_longstraw.accelerator", "ds_longstraw.config", "ds_longstraw.group", "ds_longstraw.objective",
              "ds_longstraw.seeds", "ds_longstraw.sizes", "ds_longstraw.configs"]),
    ("kernels and offload", ["ds_longstraw.kernels", "ds_longstraw.offload"]),
    ("parallel", ["ds_longstraw.parallel"]),
    ("arch", ["ds_longstraw.arch"]),
    ("models", ["ds_longstraw.models"]),
    ("grpo", ["ds_longstraw.grpo"]),
    ("rollout", ["ds_longstraw.rollout"]),
    ("engine", ["ds_longstraw.engine"]),
    ("tools", ["ds_longstraw.tools", "ds_longstraw.tasks"]),
    ("other trainers on the transaction", ["ds_longstraw.integrations"]),
    ("door, and the launcher's script that runs through it", ["ds_longstraw", "ds_longstraw.launch"]),
    ("command line, and the demo that runs the launcher's script", ["ds_longstraw.tools.cli",
                                                                    "ds_longstraw.tasks.recall_grpo",
                                                                    "ds_longstraw.tasks.recall_demo"]),
]


def _layer_of(module):
    """The index in LAYERS of the room `module` lives in (the longest matching prefix)."""
    best = None
    for index, (_, prefixes) in enumerate(LAYERS):
        for prefix in prefixes:
            if module == prefix or module.startswith(prefix + "."):
                if best is None or len(prefix) > best[1]:
                    best = (index, len(prefix))
    assert best is not None, f"{module} is in no layer of LAYERS"
    return best[0]


def _upward(edges):
    """'a -> b' for every import that runs up the layers."""
    return sorted(f"{module} -> {target}" for module, targets in edges.items() for target in targets
                  if _layer_of(target) > _layer_of(module))


def test_imports_never_run_up_the_layers():
    edges = _edges(_modules())
    assert _upward(edges) == []
    # every room is used from above, none is an island the layering says nothing about
    assert {_layer_of(module) for module in edges} == set(range(len(LAYERS)))


def test_the_layering_check_finds_an_upward_import():
    """A deliberate violation: parallel/ importing the transaction (what it did before the rooms)."""
    edges = {"ds_longstraw.parallel.groups": {"ds_longstraw.grpo.state"}, "ds_longstraw.grpo.state": set(),
             "ds_longstraw.arch.base": {"ds_longstraw.kernels.dispatch"}}
    assert _upward(edges) == ["ds_longstraw.parallel.groups -> ds_longstraw.grpo.state"]


def test_the_cycle_finder_finds_a_cycle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def _private_imports(modules):
    """'module: name from source' for every private name (one leading underscore) a module imports from a module of
    another package (folder): a private name is its own package's business; a name another package needs is public
    and says so."""
    found = []
    for module, (path, is_package) in modules.items():
        package = module if is_package else module.rpartition(".")[0]
        with open(path) as handle:
            tree = ast.parse(handle.read(), path)
        for node in ast.walk(tree):
            if not isinstance(node, ast.ImportFrom):
                continue
            if node.level:
                base = package.split(".")
                source = ".".join(base[: len(base) - (node.level - 1)] + ([node.module] if node.module else []))
            else:
                source = node.module or ""
            if source not in modules:
                continue
            source_package = source if modules[source][1] else source.rpartition(".")[0]
            if source_package == package:
                continue
            found += [f"{module}: {alias.name} from {source}" for alias in node.names
                      if alias.name.startswith("_") and not alias.name.startswith("__")]
    return sorted(found)


def test_no_private_name_is_imported_across_packages():
    assert _private_imports(_modules()) == []


def test_the_private_import_check_finds_one(tmp_path):
    """A deliberate violation (what tools/baselines.py did: the transaction's private reference-policy context),
    and a private name imported within its own package, which is allowed."""
    (tmp_path / "grpo").mkdir()
    (tmp_path / "tools").mkdir()
    (tmp_path / "grpo" / "transaction.py").write_text("def _reference_policy(): pass\n")
    (tmp_path / "grpo" / "replay.py").write_text("from .transaction import _reference_policy\n")
    (tmp_path / "tools" / "baselines.py").write_text("from ds_longstraw.grpo.transaction import _reference_policy\n")
    modules = {f"ds_longstraw.{folder}.{name}": (str(tmp_path / folder / f"{name}.py"), False)
               for folder, name in (("grpo", "transaction"), ("grpo", "replay"), ("tools", "baselines"))}
    assert _private_imports(modules) == [
        "ds_longstraw.tools.baselines: _reference_policy from ds_longstraw.grpo.transaction"]


def _combine_comparisons(modules):
    """'module:line' of every comparison of a layer's combine rule (a `.combine` attribute, or a `combine` name)
    with a string literal, a literal collection of them, or an ALL_CAPS constant, outside arch/specs.py (the rules'
    registry): everything else asks the registry (arch/specs.CombineRule's facts, grpo/cp/kinds' kind_of)."""

    def is_combine(node):
        return (isinstance(node, ast.Attribute) and node.attr == "combine") or (
            isinstance(node, ast.Name) and node.id.lower() == "combine")

    def is_literal(node):
        if isinstance(node, ast.Constant):
            return isinstance(node.value, str)
        if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
            return any(is_literal(item) for item in node.elts)
        return isinstance(node, ast.Name) and node.id.isupper()

    found = []
    for module, (path, _) in modules.items():
        if module == "ds_longstraw.arch.specs":
            continue
        with open(path) as handle:
            tree = ast.parse(handle.read(), path)
        for node in ast.walk(tree):
            if isinstance(node, ast.Compare):
                operands = [node.left, *node.comparators]
                if any(is_combine(o) for o in operands) and any(is_literal(o) for o in operands):
                    found.append(f"{module}:{node.lineno}")
    return sorted(found)


def test_no_combine_rule_is_compared_outside_its_registry():
    assert _combine_comparisons(_modules()) == []


def test_the_combine_check_finds_string_comparisons(tmp_path):
    """The violations this replaced (grpo/cp/capture.py's if/elif chain, topology's tuples, cp_sparse's constant),
    and what stays allowed (a setting that shares a rule's name, the registry's own facts)."""
    path = tmp_path / "capture.py"
    path.write_text(
        'if spec.combine == "lse":\n    pass\n'  # line 1
        'ok = spec.combine in ("lse", "topk_lse")\n'  # line 3
        'ok = any(spec.combine == COMBINE for spec in specs)\n'  # line 4
        'ok = settings.cp_attention == "lse"\n'  # a setting, not a rule
        'ok = spec.rule.layer_major and kind_of(spec) is not None\n'
        'ok = spec.combine in missing\n')  # a list the registry computed
    assert _combine_comparisons({"ds_longstraw.grpo.cp.capture": (str(path), False)}) == [
        "ds_longstraw.grpo.cp.capture:1", "ds_longstraw.grpo.cp.capture:3", "ds_longstraw.grpo.cp.capture:4"]


def test_offload_and_kernels_stand_alone():
    edges = _edges(_modules())
    for module, targets in edges.items():
        for inner in ("ds_longstraw.offload", "ds_longstraw.kernels"):
            if module == inner or module.startswith(inner + "."):
                outside = {t for t in targets if not (t == inner or t.startswith(inner + "."))}
                assert outside == set(), f"{module} imports {sorted(outside)}"


# What a qwen3_5 (or any family's) module, attribute or layer kind is called: none may appear as a name or a string
# outside arch/ and kernels/.
FAMILY_WORDS = {
    "qwen3_5", "qwen3_5_text", "glm_moe_dsa", "Qwen35Adapter", "full_attention", "linear_attention", "self_attn",
    "linear_attn", "input_layernorm", "post_attention_layernorm", "in_proj_qkv", "in_proj_z", "in_proj_a",
    "in_proj_b", "conv1d", "A_log", "dt_bias", "q_norm", "k_norm", "q_proj", "k_proj", "v_proj", "o_proj",
    "gdn_layers", "attn_layers", "gdn_state", "conv_tail", "gdn_carry", "layer_types", "num_key_value_heads",
    "num_attention_heads", "kv_lora_rank", "indexer_types", "LINEAR_ATTENTION", "FULL_ATTENTION",
}


def _code_words(path):
    """NAME tokens and whole string literals (docstrings and comments excluded) of a file."""
    with open(path) as handle:
        source = handle.read()
    docstrings = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.Module, ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                docstrings.add(first.value.lineno)
    words = []
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type == tokenize.NAME:
            words.append((token.start[0], token.string))
        elif token.type == tokenize.STRING and token.start[0] not in docstrings:
            try:
                value = ast.literal_eval(token.string)
            except (ValueError, SyntaxError):  # f-strings: their parts are checked as names
                continue
            if isinstance(value, str):
                words.append((token.start[0], value))
    return words


def test_only_arch_names_a_family():
    offenders = []
    for folder in ("ds_longstraw",):
        for dirpath, _, filenames in os.walk(os.path.join(ROOT, folder)):
            rel_dir = os.path.relpath(dirpath, ROOT)
            if rel_dir.startswith((os.path.join("ds_longstraw", "arch"), os.path.join("ds_longstraw", "kernels"))) \
                    or "__pycache__" in rel_dir:
                continue
            for name in filenames:
                if not name.endswith(".py"):
                    continue
                path = os.path.join(dirpath, name)
                for line, word in _code_words(path):
                    if word in FAMILY_WORDS:
                        offenders.append(f"{os.path.relpath(path, ROOT)}:{line}: {word}")
    assert offenders == []


def test_the_family_word_check_sees_code_not_docstrings(tmp_path):
    sample = tmp_path / "sample.py"
    sample.write_text('"""Mentions self_attn in prose."""\n\nx = layer.self_attn  # and here\ny = "conv_tail"\n')
    assert [w for _, w in _code_words(sample) if w in FAMILY_WORDS] == ["self_attn", "conv_tail"]


@pytest.mark.skipif(shutil.which("ruff") is None and subprocess.run(
    [sys.executable, "-m", "ruff", "--version"], capture_output=True).returncode != 0, reason="ruff not installed")
def test_ruff_is_clean():
    result = subprocess.run([sys.executable, "-m", "ruff", "check", "."], cwd=ROOT, capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr
