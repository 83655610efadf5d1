"""A stand-in for torchvision in the interop venv: sglang and transformers import it at module level, and PyPI's only
build of it is CUDA's, which does not load beside CPU torch. Anything used from it raises."""
from torchvision import io, transforms  # noqa: F401
from torchvision._missing import missing

__version__ = "0.0+interop-stub"
__getattr__ = missing(__name__)
