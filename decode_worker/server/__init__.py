"""The HTTP surface: a FastAPI router per API family, request schemas, errors and the guard.

How the packages fit together: docs/architecture.md."""
