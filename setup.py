"""Build hook: compile the cache's hot modules with mypyc and the engine's decode kernels with
Cython (kvtrace/compiled.py lists both).

Everything else about the package is in pyproject.toml. Pure Python when
KVTRACE_PURE_PYTHON=1, or when mypyc cannot run here (said below, and the install goes on);
a C extension that fails to compile is optional, so it leaves the sources in charge
(kvtrace.compiled falls back to all of them).
"""

import os
import runpy
import sys

from setuptools import setup

compiled = runpy.run_path(os.path.join("kvtrace", "compiled.py"))
ext_modules = []
if os.environ.get(compiled["ENV"], "") in ("", "0"):
    try:
        from mypyc.build import mypycify
    except ImportError as e:  # (pyproject.toml's build requirements name mypy)
        print(f"kvtrace: mypyc unavailable ({e}); installing pure Python", file=sys.stderr)
    else:
        paths = [os.path.join(*m.split(".")) + ".py" for m in compiled["COMPILED"]]
        ext_modules = mypycify(paths, opt_level="3", group_name=compiled["GROUP"])
        for ext in ext_modules:
            ext.optional = True

    try:
        from Cython.Build import cythonize
    except ImportError as e:  # (pyproject.toml's build requirements name Cython)
        print(f"kvtrace: Cython unavailable ({e}); the engine's kernels take their numpy path", file=sys.stderr)
    else:
        pyx = [os.path.join(*m.split(".")) + ".pyx" for m in compiled["CYTHON"]]
        for ext in cythonize(pyx, quiet=True):
            ext.optional = True
            ext_modules.append(ext)

# The mypyc group (one large C file, most of the build) and the Cython kernels compile side by
# side: about 15 s less of an install on 2 cores
setup(ext_modules=ext_modules, options={"build_ext": {"parallel": 2}})
