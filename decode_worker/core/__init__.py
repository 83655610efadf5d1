"""Plain types every layer shares; imports no other package of the worker."""
