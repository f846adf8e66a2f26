"""setuptools hook: bundle libkvxfer.so into the kvxfer package when it is
built (`make python-wheel`, or pip wheel/install --no-build-isolation
./python). The library comes from KVXFER_LIBRARY, else
../build/python/libkvxfer.so (`make python-lib`); without either the package
is built without it and finds the library through KVXFER_LIBRARY or the
linker path at run time. A wheel with the library inside is tagged for this
platform (py3-none-linux_<arch>: the library does not depend on the Python
version), one without it stays py3-none-any. Metadata lives in
pyproject.toml."""

import os
import shutil

from setuptools import setup
from setuptools.command.build_py import build_py

HERE = os.path.dirname(os.path.abspath(__file__))


def library():
    """The libkvxfer.so to bundle, or None."""
    lib = os.environ.get("KVXFER_LIBRARY") or os.path.join(HERE, "..", "build", "python", "libkvxfer.so")
    return lib if os.path.isfile(lib) else None


class build_py_with_lib(build_py):
    def run(self):
        super().run()
        lib = library()
        dst = os.path.join(self.build_lib, "kvxfer", "libkvxfer.so")
        if lib:
            self.announce(f"kvxfer: bundling {lib}", level=2)
            shutil.copyfile(lib, dst)
        else:
            if os.path.exists(dst):  # left by an earlier build: never ship a stale library
                os.remove(dst)
            self.announce("kvxfer: no libkvxfer.so to bundle (set KVXFER_LIBRARY or run `make python-lib`); "
                          "the package will look for it at run time", level=3)


cmdclass = {"build_py": build_py_with_lib}
try:
    from wheel.bdist_wheel import bdist_wheel  # Debian: python3-wheel
except ImportError:  # no wheel: pip reports "invalid command 'bdist_wheel'"; install python3-wheel
    bdist_wheel = None

if bdist_wheel is not None:

    class bdist_wheel_platform(bdist_wheel):
        """A platform wheel when it carries libkvxfer.so."""

        def finalize_options(self):
            super().finalize_options()
            if library():
                self.root_is_pure = False

        def get_tag(self):
            impl, abi, plat = super().get_tag()
            if library():
                return "py3", "none", plat
            return impl, abi, plat

    cmdclass["bdist_wheel"] = bdist_wheel_platform

setup(cmdclass=cmdclass)
