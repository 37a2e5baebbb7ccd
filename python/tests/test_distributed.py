"""Ranks on one node sharing one cold kernel cache (tools/dist_train.py under torchrun):
every rank's losses equal the single-GPU run's, the cache ends with one valid entry per key
and no temp files. Eight ranks where eight GPUs are (as many as there are from two on);
skipped with fewer than two GPUs."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs")


@pytest.mark.parametrize("prebuilt", [False, True])
def test_ranks_share_a_cold_cache_and_train_like_one_gpu(tmp_path: Path, prebuilt: bool) -> None:
    ranks = min(8, torch.cuda.device_count())
    cache = tmp_path / "cache"
    out = tmp_path / "result.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={ranks}",
           str(REPO / "tools" / "dist_train.py"), "--cache", str(cache), "--out", str(out)]
    if prebuilt:
        cmd.append("--prebuilt")
    env = dict(os.environ, NCCL_NVLS_ENABLE="0", TORCH_SYMM_MEM_DISABLE_MULTICAST="1",
               NVSHMEM_DISABLE_NVLS="1")
    run = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=900)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-4000:]
    result = json.loads(out.read_text())
    assert result["world"] == ranks
    assert result["worst_relative"] <= 1e-2, result
    cache_state = result["cache"]
    assert cache_state["temp_files"] == [] and cache_state["invalid"] == [], cache_state
    assert cache_state["entries"] == cache_state["distinct_keys"], cache_state
    if not prebuilt:  # with the prebuilt layer the production set needs no entry of its own
        assert cache_state["entries"] > 0, cache_state
    print(f"cold start per rank (prebuilt={prebuilt}):", result["cold_start_s"])
