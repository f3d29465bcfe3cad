"""Starting the real `deepspeed` launcher from pytest: CPU ranks on gloo, one thread each, logs kept for failures."""

import os
import socket
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DEEPSPEED = os.path.join(os.path.dirname(sys.executable), "deepspeed")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def launcher_env():
    env = dict(os.environ)
    # Two ranks on a small shared CPU box: one thread each (several times faster than oversubscribing).
    env.update(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false", PYTHONUNBUFFERED="1")
    return env


def start(launcher_args, script_args, log_path):
    """Popen of `deepspeed <launcher_args> <script_args>` from the repository root, output to log_path."""
    log = open(log_path, "w")
    return subprocess.Popen([DEEPSPEED, *launcher_args, *script_args], cwd=REPO, env=launcher_env(),
                            stdout=log, stderr=subprocess.STDOUT, start_new_session=True)


def finish(processes, timeout, logs):
    """Wait for every process; on timeout kill their process groups. Returns the return codes; raises
    AssertionError with the logs' tails when one failed."""
    import signal

    codes = []
    try:
        for process in processes:
            codes.append(process.wait(timeout=timeout))
    except subprocess.TimeoutExpired:
        for process in processes:
            if process.poll() is None:
                os.killpg(process.pid, signal.SIGKILL)
        codes = [process.wait() for process in processes]
        codes.append("timeout")
    if any(code != 0 for code in codes):
        tails = []
        for path in logs:
            with open(path) as handle:
                lines = [line for line in handle if " [INFO] " not in line]
            tails.append(f"--- {path} ---\n" + "".join(lines[-40:]))
        raise AssertionError(f"launcher exit codes {codes}\n" + "\n".join(tails))
    return codes
