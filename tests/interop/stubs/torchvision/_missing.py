def missing(module: str):
    """A module ``__getattr__`` whose every name is a function that raises: nothing here may really be used."""
    def attribute(name: str):
        if name.startswith("__"):
            raise AttributeError(name)

        def unavailable(*args, **kwargs):
            raise NotImplementedError(f"{module}.{name}: torchvision is a stub in the interop venv")
        return unavailable
    return attribute
