"""examples/train_fsdp.py as a user runs it: ``torchrun --nproc_per_node 2 examples/train_fsdp.py --quick`` on CPU
(gloo), a model sharded with FSDP2 trained privately; the ranks report one epsilon, each holds a shard."""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("sklearn", reason='the example needs the examples extra: pip install -e ".[examples]"')

ROOT = Path(__file__).resolve().parents[2]
TIMEOUT_S = 420  # far above a normal run (the two processes importing torch take most of it); only a hang reaches it


def test_torchrun_two_processes_quick(tmp_path):
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_gloo_available():
        pytest.skip("this torch build has no torch.distributed with gloo")
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""), OMP_NUM_THREADS="1")
    if any(name == "lo" for _, name in socket.if_nameindex()):
        env["GLOO_SOCKET_IFNAME"] = "lo"  # loopback only
    done, text = _torchrun(env, tmp_path)
    if done.returncode != 0 and TEARDOWN_ABORT in text and "final: test accuracy" in text:
        # Seen once in CI on a loaded machine: every line printed, then rank 0 aborted in the C++ teardown at
        # exit (torch's threads; fxdp starts none). Run again once: the second run must exit cleanly.
        done, text = _torchrun(env, tmp_path)
    assert done.returncode == 0, text[-6000:]
    assert re.search(r"fxdp compile report for (FSDP)?DeepMLP\n", text)
    assert "sharded with FSDP2 (fully_shard): 2 ranks on a 1-D cpu mesh" in text
    assert "5 units: <model>, blocks.0, blocks.1, blocks.2, blocks.3" in text
    assert "  head: rule for Linear, book-kept" in text
    assert "2 processes (gloo), FSDP2 over a mesh of 2; Poisson sampling of the 400 training digits at rate 0.2500" \
        in text
    assert "epoch   1   test accuracy" in text and "epoch   2   test accuracy" in text
    held = re.search(r"each rank holds (\d+), (\d+) of the (\d+) parameter values; epsilon on every rank: "
                     r"([\d.]+), ([\d.]+)", text)
    assert held is not None, text[-3000:]
    a, b, total = (int(held.group(i)) for i in (1, 2, 3))
    assert a + b == total and 0 < b <= a < total  # sharded: each rank a part, together the whole model
    assert held.group(4) == held.group(5)
    final = re.search(r"final: test accuracy ([\d.]+)% at epsilon ([\d.]+) \(delta 1e-05\); same epsilon on all 2 "
                      r"ranks: True", text)
    assert final is not None, text[-3000:]
    # the noise was calibrated for the two epochs: epsilon just below the target of 3
    assert 0.99 * 3.0 <= float(final.group(2)) <= 3.0
    assert 0.0 <= float(final.group(1)) <= 100.0


TEARDOWN_ABORT = "terminate called without an active exception"


def _torchrun(env, tmp_path):
    log = tmp_path / "torchrun.log"
    with open(log, "w") as out:  # (a file, not a pipe: a full pipe would block a rank)
        done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                               str(ROOT / "examples" / "train_fsdp.py"), "--quick"],
                              env=env, stdout=out, stderr=subprocess.STDOUT, timeout=TIMEOUT_S, cwd=tmp_path)
    return done, log.read_text()
