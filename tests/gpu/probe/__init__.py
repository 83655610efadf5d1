"""The GPU probe's sections (``tests/gpu/gpu_probe.py`` runs each in its own process). Every section takes ``tiny``:
True runs it on CPU with tiny shapes (Triton under ``TRITON_INTERPRET=1``) so the CPU tests catch a broken section.
"""
