"""csa.compress in one process on two GPUs: threads alternating between the devices and their
streams, CUDA graphs on each device, every result bitwise equal to the one-GPU run. Skipped
with fewer than two GPUs."""

from __future__ import annotations

import threading

import pytest
import torch

import csa
from helpers import make_pack

pytestmark = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs")

CONFIGS = [(4, 2, 128), (128, 1, 512), (2, 1, 65)]


def run(p: object, device: int) -> tuple[torch.Tensor, ...]:
    kv, score, ape = (t.detach().to(device).requires_grad_(True) for t in (p.kv, p.score, p.ape))
    cu, cuc = p.cu_seqlens.to(device), p.cu_seqlens_comp.to(device)
    out = csa.compress(kv, score, ape, cu, cuc, ratio=p.ratio, coff=p.coff,
                       total_comp=p.total_comp)
    grads = torch.autograd.grad(out, (kv, score, ape), torch.ones_like(out))
    return tuple(t.cpu() for t in (out.detach(), *grads))


def packs() -> list[object]:
    return [make_pack(r, c, d, [1000, 0, 2048, 3 * r + 1], seed_value=7 + r) for r, c, d in CONFIGS]


@pytest.fixture(autouse=True)
def deterministic() -> object:
    was = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    yield
    torch.use_deterministic_algorithms(was)


def test_threads_on_both_devices_match_the_one_gpu_run() -> None:
    ps = packs()
    expected = [run(p, 0) for p in ps]
    errors: list[str] = []

    def worker(t: int) -> None:
        try:
            for r in range(4):
                device = (t + r) % 2
                stream = torch.cuda.Stream(device)
                with torch.cuda.device(device), torch.cuda.stream(stream):
                    for p, ref in zip(ps, expected):
                        got = run(p, device)
                        torch.cuda.current_stream(device).synchronize()
                        if not all(torch.equal(a, b) for a, b in zip(got, ref)):
                            errors.append(f"thread {t} device {device}: {p.describe()}")
        except Exception as e:  # noqa: BLE001  # reported below with the thread
            errors.append(f"thread {t}: {e!r}")

    threads = [threading.Thread(target=worker, args=(t,)) for t in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert not errors, errors


def test_cuda_graphs_on_each_device_replay_the_one_gpu_results() -> None:
    for p in packs():
        ref = run(p, 0)
        for device in (0, 1):
            csa.prewarm(ratio=p.ratio, coff=p.coff, head_dim=p.head_dim, device=device)
            with torch.cuda.device(device):
                kv, score, ape = (t.detach().to(device).requires_grad_(True)
                                  for t in (p.kv, p.score, p.ape))
                cu, cuc = p.cu_seqlens.to(device), p.cu_seqlens_comp.to(device)

                def step() -> tuple[torch.Tensor, ...]:
                    out = csa.compress(kv, score, ape, cu, cuc, ratio=p.ratio, coff=p.coff,
                                       total_comp=p.total_comp)
                    return (out,) + torch.autograd.grad(out, (kv, score, ape),
                                                        torch.ones_like(out))

                side = torch.cuda.Stream(device)
                with torch.cuda.stream(side):
                    step()
                torch.cuda.current_stream(device).wait_stream(side)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph):
                    captured = step()
                graph.replay()
                torch.cuda.synchronize(device)
                for a, b in zip(captured, ref):
                    assert torch.equal(a.detach().cpu(), b), (device, p.describe())
