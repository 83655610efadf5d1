from torchvision._missing import missing

__getattr__ = missing(__name__)
