from enum import Enum

from torchvision._missing import missing


class InterpolationMode(Enum):  # transformers reads its members at import
    NEAREST = "nearest"
    NEAREST_EXACT = "nearest-exact"
    BILINEAR = "bilinear"
    BICUBIC = "bicubic"
    BOX = "box"
    HAMMING = "hamming"
    LANCZOS = "lanczos"


__getattr__ = missing(__name__)
