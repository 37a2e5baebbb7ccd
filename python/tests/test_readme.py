"""The README's quick-start code runs as written: the Python block (on meta tensors without a
GPU), and the C++ block compiled against the installed package's library and run (without a
GPU it stops after compiling for sm_90)."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import csa

REPO = Path(__file__).resolve().parents[2]


def block(language: str) -> str:
    text = (REPO / "README.md").read_text()
    match = re.search(rf"<!-- quickstart:{language} -->\s*```\w+\n(.*?)```", text, re.S)
    assert match, f"README has no {language} quick start"
    return match.group(1)


def library() -> Path:
    from csa import _lib
    return _lib.find_library()


def test_the_python_quick_start_runs(tmp_path: Path) -> None:
    script = tmp_path / "quickstart.py"
    script.write_text(block("python"))
    env = dict(os.environ, CSA_CACHE_DIR=str(tmp_path / "cache"))
    run = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=env,
                         timeout=600)
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip().splitlines()[-1] == "(2048, 512) (8192, 1024) (4, 1024)"


def test_the_cpp_quick_start_compiles_and_runs(tmp_path: Path) -> None:
    cuda = Path(os.environ.get("CUDA_HOME", "/usr/local/cuda"))
    compiler = shutil.which("g++") or shutil.which("c++")
    if compiler is None or not (cuda / "include" / "cuda_runtime.h").is_file():
        pytest.skip("needs a C++ compiler and the CUDA toolkit's headers")
    source = tmp_path / "quickstart.cpp"
    source.write_text(block("cpp"))
    lib = library()
    link = tmp_path / "libcsa.so"
    link.symlink_to(lib)
    cudart = next((p for p in (cuda / "lib64", cuda / "lib") if (p / "libcudart.so").exists()),
                  None)
    if cudart is None:
        pytest.skip("no libcudart.so in the CUDA toolkit")
    binary = tmp_path / "quickstart"
    subprocess.run([compiler, "-std=c++17", str(source), f"-I{REPO / 'include'}",
                    f"-I{cuda / 'include'}", f"-L{tmp_path}", f"-L{cudart}", "-lcsa", "-lcudart",
                    f"-Wl,-rpath,{lib.parent}", f"-Wl,-rpath,{cudart}", "-o", str(binary)],
                   check=True, capture_output=True, text=True)
    env = dict(os.environ, CSA_CACHE_DIR=str(tmp_path / "cache"))
    run = subprocess.run([str(binary)], capture_output=True, text=True, env=env, timeout=600)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "kernels for sm_90" in run.stdout
    if csa.info()["devices"]:
        assert "forward: no error" in run.stdout


def test_the_prebuilt_kernels_are_a_read_only_layer() -> None:
    layers = [layer for layer in csa.info()["cache"]["layers"]
              if layer["directory"].endswith("csa-kernels")]
    if not layers or layers[0]["state"] == "absent":
        pytest.skip("this libcsa was built without -DCSA_PREBUILT_KERNELS=ON")
    assert layers[0]["read_only_layer"] and layers[0]["state"] == "read-only"
    assert layers[0]["entries"] == 8  # the production set for sm_90 and sm_100
