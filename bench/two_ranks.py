"""Start a benchmark's rank script under the real `deepspeed` launcher on 2 CPU ranks, in fresh processes.

The rank script writes <result>/rank<r>.json; `launch_two_ranks` returns the two ranks' results, or raises with the
launcher log's tail. One thread per rank on a small shared box; freed blocks of 1 MiB and more go back to the
kernel, so a rank's VmHWM measures its own work.
"""

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def free_port():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def add_rank_script_arguments(parser):
    """The hidden arguments `launch_two_ranks` gives the rank script (and the launcher's --local_rank)."""
    parser.add_argument("--rank-script", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--result", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--local_rank", type=int, default=-1, help=argparse.SUPPRESS)


def launch_two_ranks(script, script_args, label):
    """`deepspeed --num_gpus 2 script --result DIR *script_args` from the repository root (bench/ and the root on
    PYTHONPATH); returns [rank 0's result, rank 1's]. label: names the run in errors and the result folder."""
    result = tempfile.mkdtemp(prefix=f"{label}_")
    deepspeed = os.path.join(os.path.dirname(sys.executable), "deepspeed")
    command = [deepspeed, "--num_gpus", "2", "--master_port", str(free_port()), os.path.abspath(script),
               "--rank-script", "--result", result, *script_args]
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", MALLOC_MMAP_THRESHOLD_="1048576",
               PYTHONUNBUFFERED="1", PYTHONWARNINGS="ignore",
               PYTHONPATH=os.pathsep.join([os.path.dirname(os.path.abspath(__file__)), ROOT]))
    log = os.path.join(result, "launcher.log")
    with open(log, "w") as handle:
        code = subprocess.run(command, cwd=ROOT, env=env, stdout=handle, stderr=subprocess.STDOUT).returncode
    if code != 0:
        with open(log) as handle:
            tail = [line for line in handle if " [INFO] " not in line][-40:]
        raise RuntimeError(f"{label}: launcher exit code {code}\n" + "".join(tail))
    ranks = []
    for rank in range(2):
        with open(os.path.join(result, f"rank{rank}.json")) as handle:
            ranks.append(json.load(handle))
    return ranks
