"""Source-checkout shim: ``kernels/`` installs as ``decode_worker_kernels`` (setup.py's ``package_dir``), so a bare
checkout run with ``PYTHONPATH=.`` (the GPU probe on a machine where the project is not installed) would not find
it. This module loads ``kernels/__init__.py`` under that name, with ``kernels/`` as its package path, and puts it
in its own place in ``sys.modules``: every ``decode_worker_kernels.*`` import then reads ``kernels/``, exactly as
the installed package does. An installed project never sees this file (it is not packaged).
"""
import importlib.util
import sys
from pathlib import Path

_KERNELS = Path(__file__).resolve().parent.parent / "kernels"
_spec = importlib.util.spec_from_file_location(__name__, _KERNELS / "__init__.py",
                                               submodule_search_locations=[str(_KERNELS)])
_module = importlib.util.module_from_spec(_spec)
sys.modules[__name__] = _module
_spec.loader.exec_module(_module)
