"""The wheel, installed outside the checkout, runs the commands a user starts with.

The wheel is built from a copy of the checkout (a build writes build/ and *.egg-info/ into the tree it builds) and
installed with `pip install --no-deps --target` into a temporary folder. Its commands run from a directory outside
the checkout under `python -S`: without the site module no .pth file runs, so the checkout's editable install (an
import hook that maps ds_longstraw's folders to the checkout) cannot answer an import the wheel should have answered;
the dependencies come from this environment's site-packages, named on PYTHONPATH after the install.

  import:  ds_longstraw, its mapped subpackages and its configs are the installed files, not the checkout's;
  plan:    `longstraw plan --model qwen3.6-27b` (a built-in shape, read from the package) exits 0 with its tables;
           a failing plan exits 2 through the console script;
  demo:    `longstraw demo` on a 256-token prompt (its shape from the package; the conventional baseline measured in
           a fresh process, which imports the installed package too) exits 0 and ends with its verdict;
  recall:  what `longstraw demo --task recall` reads resolves in the install: the training helpers it imports, the
           run config, the DeepSpeed config it names, the task's model shape, reward and prompt functions. (The
           training itself starts a DeepSpeed process group; test_recall_task.py covers it.)
"""

import json
import os
import re
import shutil
import site
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# Left out of the copy that is built: version control, environments, caches and earlier outputs
NOT_BUILT = shutil.ignore_patterns(".git", ".venv", "__pycache__", "*.egg-info", "build", "runs", ".pytest_cache",
                                   ".ruff_cache", ".fla_interp", ".whl")

pytestmark = pytest.mark.slow  # a wheel build and five fresh interpreters: about 40 s on 2 cores


@pytest.fixture(scope="module")
def install(tmp_path_factory):
    """(the install folder, an empty working directory outside the checkout, the environment to run in)."""
    tmp = tmp_path_factory.mktemp("packaging")
    shutil.copytree(ROOT, tmp / "src", ignore=NOT_BUILT)
    env = dict(os.environ, PIP_DISABLE_PIP_VERSION_CHECK="1", PIP_NO_INDEX="1")  # nothing from an index

    def pip(*args):
        result = subprocess.run([sys.executable, "-m", "pip", *args], capture_output=True, text=True, env=env,
                                timeout=300)
        assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]

    pip("wheel", "-q", "--no-deps", "--no-build-isolation", "-w", str(tmp / "wheel"), str(tmp / "src"))
    wheels = list((tmp / "wheel").glob("ds_longstraw-*.whl"))
    assert len(wheels) == 1, wheels
    pip("install", "-q", "--no-deps", "--target", str(tmp / "site"), str(wheels[0]))
    (tmp / "elsewhere").mkdir()
    env["PYTHONPATH"] = os.pathsep.join([str(tmp / "site"), *site.getsitepackages()])
    return tmp / "site", tmp / "elsewhere", env


def _run(install, *args, timeout=300):
    """`python -S args...` in the working directory outside the checkout."""
    _, cwd, env = install
    return subprocess.run([sys.executable, "-S", *args], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=timeout)


def _longstraw(install, *args, timeout=300):
    """The installed console script, run by this interpreter (its own first line names this environment's python,
    which would start without -S)."""
    return _run(install, str(install[0] / "bin" / "longstraw"), *args, timeout=timeout)


def _under(path, folder) -> bool:
    return os.path.realpath(path).startswith(os.path.realpath(folder) + os.sep)


def test_imports_come_from_the_install(install):
    code = ("import json, ds_longstraw, ds_longstraw.configs, ds_longstraw.kernels, ds_longstraw.offload, "
            "ds_longstraw.launch, ds_longstraw.tasks, ds_longstraw.integrations.trl; "
            "from ds_longstraw.models.modeling import MODELS_DIR; "
            "print(json.dumps([m.__file__ for m in (ds_longstraw, ds_longstraw.configs, ds_longstraw.kernels, "
            "ds_longstraw.offload, ds_longstraw.launch, ds_longstraw.tasks, ds_longstraw.integrations.trl)] "
            "+ [str(MODELS_DIR)]))")
    result = _run(install, "-c", code)
    assert result.returncode == 0, result.stderr[-3000:]
    files = json.loads(result.stdout.strip().splitlines()[-1])
    assert [f for f in files if not _under(f, install[0])] == []
    assert sorted(os.listdir(files[-1])) == sorted(f for f in os.listdir(os.path.join(ROOT, "configs", "models"))
                                                   if f.endswith(".yaml"))


def test_plan_of_a_built_in_model(install):
    result = _longstraw(install, "plan", "--model", "qwen3.6-27b", "--context", "1M", "--gpu-memory", "80GB",
                        "--host-memory", "512GB")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert result.stdout.startswith("# longstraw plan: qwen3.6-27b (qwen3_5_text, ~26.9B parameters)")
    assert "## Retained bytes per rank" in result.stdout and "## Where it fits (per rank)" in result.stdout
    failed = _longstraw(install, "plan", "--model", "no-such-model", "--context", "1M", "--gpu-memory", "80GB",
                        "--host-memory", "512GB")
    assert failed.returncode == 2 and "'no-such-model' is neither a built-in shape" in failed.stderr


def test_demo(install):
    result = _longstraw(install, "demo", "--prompt", "256", "--group", "2", "--response", "8", "--chunk", "128",
                        "--baseline", "measure", timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    out = [line for line in result.stdout.splitlines() if line.strip()]
    assert out[0].startswith("ds_longstraw demo: small model (random weights), prompt 256 tokens, G = 2")
    assert any(line.startswith("GRPO step done: loss ") for line in out)
    assert "retained prompt state by layer type:" in out
    assert re.fullmatch(r"ds_longstraw vs conventional, prompt 256 tokens, G = 2: step peak \d+\.\d\dx .*", out[-1])


def test_recall_task_reads_the_installed_files(install):
    code = """
import json
from ds_longstraw.engine.config import load_ds_config
from ds_longstraw.models.modeling import config_from_shape
from ds_longstraw.rollout.step import parse_rollout
from ds_longstraw.engine.run_config import load_run_config
from ds_longstraw.launch import train
from ds_longstraw.tasks import recall_demo, recall_grpo

run = load_run_config(recall_grpo.RUN_CONFIG, recall_grpo.shipped_overrides())
load_ds_config(run.deepspeed_config)
config_from_shape(recall_demo.SHAPE)
rollout = parse_rollout(dict(run.rollout))
functions = [rollout.reward_function(), rollout.prompt_function()]
print(json.dumps([train.__file__, str(recall_grpo.RUN_CONFIG), run.deepspeed_config, str(recall_demo.SHAPE),
                  *(__import__(f.__module__, fromlist=["_"]).__file__ for f in functions)]))
"""
    result = _run(install, "-c", code)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    files = json.loads(result.stdout.strip().splitlines()[-1])
    assert len(files) == 6 and all(os.path.isfile(f) for f in files)
    assert [f for f in files if not _under(f, install[0])] == []
