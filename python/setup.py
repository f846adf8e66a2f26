"""setuptools hook: bundle libkvxfer.so into the kvxfer package when it is
built (pip install ./python). The library comes from KVXFER_LIBRARY, else
../build/python/libkvxfer.so (`make python-lib`); without either the package
is installed without it and finds the library through KVXFER_LIBRARY or the
linker path at run time. Metadata lives in pyproject.toml."""

import os
import shutil

from setuptools import setup
from setuptools.command.build_py import build_py

HERE = os.path.dirname(os.path.abspath(__file__))


class build_py_with_lib(build_py):
    def run(self):
        super().run()
        lib = os.environ.get("KVXFER_LIBRARY") or os.path.join(HERE, "..", "build", "python", "libkvxfer.so")
        dst = os.path.join(self.build_lib, "kvxfer", "libkvxfer.so")
        if os.path.isfile(lib):
            self.announce(f"kvxfer: bundling {lib}", level=2)
            shutil.copyfile(lib, dst)
        else:
            self.announce("kvxfer: no libkvxfer.so to bundle (set KVXFER_LIBRARY or run `make python-lib`); "
                          "the package will look for it at run time", level=3)


setup(cmdclass={"build_py": build_py_with_lib})
