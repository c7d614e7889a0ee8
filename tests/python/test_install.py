"""`pip install .` (README, docs/python.md): into a fresh virtual environment, offline, with Debian's
setuptools; then `import kiln` there, from outside the source tree, runs a graph."""
import os
import pathlib
import subprocess
import sys
import textwrap

import pytest

from conftest import SOURCE_DIR

BUILD_DIR = pathlib.Path(os.environ.get("PYTHONPATH", "").split(os.pathsep)[0] or SOURCE_DIR / "build" / "python").parent


@pytest.mark.skipif(not (BUILD_DIR / "CMakeCache.txt").exists(), reason="needs the CMake build folder the package is built in")
def test_pip_install_into_a_venv_then_import_from_elsewhere(tmp_path):
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", str(venv)], check=True)
    env = dict(os.environ, KILN_BUILD_DIR=str(BUILD_DIR), PIP_NO_INDEX="1")
    env.pop("PYTHONPATH", None)        # the installed package, not the build tree's
    subprocess.run([str(venv / "bin" / "pip"), "install", "--no-build-isolation", "-q", str(SOURCE_DIR)],
                   check=True, env=env, cwd=tmp_path)
    script = textwrap.dedent("""
        import numpy as np, kiln
        from kiln.dtype import DType
        from kiln.driver import CPU
        from kiln.engine import InferenceSession
        from kiln.graph import Graph, TensorType
        assert kiln.__file__.startswith(%r), kiln.__file__
        g = Graph("double", forward=lambda x: x * 2 + 1, input_types=[TensorType(DType.float32, [3])])
        y = InferenceSession(devices=[CPU()]).load(g).execute(np.arange(3, dtype=np.float32))[0]
        print(np.from_dlpack(y).tolist())
    """ % str(venv))
    out = subprocess.run([str(venv / "bin" / "python"), "-c", script], check=True, env=env, cwd=tmp_path,
                         capture_output=True, text=True)
    assert out.stdout.strip() == "[1.0, 3.0, 5.0]"
