"""Launching a test file's ranks: ``python FILE RANK OUT_DIR STORE`` for each rank, on localhost with gloo,
rendezvous through a file store (no port to pick), output to log files, every wait bounded."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import List

import torch

ROOT = Path(__file__).resolve().parents[2]


def launch_ranks(script: str, out: Path, world: int, timeout_s: float, extra_env=None) -> List[dict]:
    """Runs ``script`` as ``world`` ranks and returns what each saved as ``out/rank{r}.pt``; a failed or
    hung rank fails the caller with every rank's log. Skips the caller where this torch has no gloo."""
    import pytest
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_gloo_available():
        pytest.skip("this torch build has no torch.distributed with gloo")
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""),
               OMP_NUM_THREADS="1", **(extra_env or {}))
    if any(name == "lo" for _, name in socket.if_nameindex()):
        env["GLOO_SOCKET_IFNAME"] = "lo"  # loopback only
    logs = [out / f"rank{r}.log" for r in range(world)]
    procs = []
    for r in range(world):  # output to files: a full pipe would block one rank and with it the others
        with open(logs[r], "w") as log:
            procs.append(subprocess.Popen([sys.executable, script, str(r), str(out), str(out / "store")], env=env,
                                          stdout=log, stderr=subprocess.STDOUT))
    deadline = time.monotonic() + timeout_s
    try:
        for p in procs:
            p.wait(timeout=max(1.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        pass  # killed below, reported with the logs
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    codes = [p.returncode for p in procs]
    assert codes == [0] * world, f"ranks failed or hung (over {timeout_s} s, killed):\n" + "\n".join(
        f"--- rank {r} (exit {c})\n{logs[r].read_text()[-5000:]}" for r, c in enumerate(codes))
    return [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(world)]
