"""Builds kiln._kiln with CMake for `pip install .` (metadata: pyproject.toml).

The extension is the build's kiln_python target: in the CMake build directory $KILN_BUILD_DIR
(default: build/, configured with the default preset when it is not there yet), so an existing build
is reused. It links kiln statically, so the wheel needs no libkiln.so.
"""
import os
import pathlib
import shutil
import subprocess
import sys

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

SOURCE = pathlib.Path(__file__).resolve().parent


class CMakeBuild(build_ext):
    def build_extension(self, ext):
        build_dir = pathlib.Path(os.environ.get("KILN_BUILD_DIR", SOURCE / "build")).resolve()
        if not (build_dir / "CMakeCache.txt").exists():
            subprocess.check_call(["cmake", "-S", str(SOURCE), "-B", str(build_dir), "-G", "Ninja",
                                   "-DCMAKE_BUILD_TYPE=RelWithDebInfo", f"-DPython3_EXECUTABLE={sys.executable}"])
        subprocess.check_call(["cmake", "--build", str(build_dir), "--target", "kiln_python"])
        built = next((build_dir / "python" / "kiln").glob("_kiln*.so"))
        target = pathlib.Path(self.get_ext_fullpath(ext.name))
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(built, target)
        if shutil.which("strip"):  # the build's debug info is most of the file (about 45 of 48 MB)
            subprocess.check_call(["strip", "--strip-debug", str(target)])


setup(ext_modules=[Extension("kiln._kiln", sources=[])],
      cmdclass={"build_ext": CMakeBuild},
      # setuptools' own scratch space inside the CMake build folder, not beside it.
      options={"build": {"build_base": os.environ.get("KILN_BUILD_DIR", "build") + "/setuptools"},
               "egg_info": {"egg_base": os.environ.get("KILN_BUILD_DIR", "build")}})
