"""Print the CUTLASS/CuTe include directory shipped in the ``nvidia-cutlass`` wheel.

Uses ``importlib.util.find_spec`` so that the ``cutlass_library`` package is located without
being imported (importing it loads its Python kernel generators, which is slow).
Exits non-zero with a message when the wheel is not installed.
"""

import importlib.util
import pathlib
import sys

spec = importlib.util.find_spec("cutlass_library")
if spec is None or not spec.submodule_search_locations:
    sys.exit("the nvidia-cutlass wheel (Python package cutlass_library) is not installed in " + sys.executable)
package_dir = pathlib.Path(next(iter(spec.submodule_search_locations)))
print((package_dir / "source" / "include").as_posix())
