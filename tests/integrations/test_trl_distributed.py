"""RoutingReplayGRPOTrainer on 2 CPU processes (accelerate over gloo): each process generates its own rows, TRL
gathers rewards across processes and slices the advantages back, and the routes follow each process's rows."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import free_port

pytest.importorskip("trl")

HERE = Path(__file__).parent


def test_two_processes_replay_their_own_rows(tmp_path):
    procs, port = [], free_port()
    for rank in range(2):
        env = {
            **os.environ,
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "RANK": str(rank),
            "LOCAL_RANK": str(rank),
            "WORLD_SIZE": "2",
            "LOCAL_WORLD_SIZE": "2",
            "OMP_NUM_THREADS": "1",
            "PYTHONPATH": os.pathsep.join([str(HERE), str(HERE.parent), os.environ.get("PYTHONPATH", "")]),
        }
        procs.append(
            subprocess.Popen(
                [sys.executable, str(HERE / "trl_worker.py"), str(tmp_path)],
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
        )
    try:
        logs = [p.communicate(timeout=300)[0] for p in procs]
    finally:  # (a rank that hangs is not left running after the test)
        for p in procs:
            p.kill()
    assert all(p.returncode == 0 for p in procs), "\n".join(log[-3000:] for log in logs)
    results = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert [r["world"] for r in results] == [2, 2]
    for r in results:
        assert r["used"] and all(r["used"])  # every loss forward used the replayed experts
        # each rank's routes are its own rows': they agree with a live forward of those rows wherever it has no
        # near-tie, where one position of shift would not
        assert min(r["agree"]) == 1.0 and max(r["shifted"]) < 0.5
        assert max(r["logps"]) < 1e-4
        assert any(m is not None for m in r["moved"])
    assert results[0]["prompts"] != results[1]["prompts"]  # each process generated its own rows
