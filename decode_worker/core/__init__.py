"""Plain types every layer shares (requests, lifecycle states, policies, small utilities); imports no other package of
the worker.

How the packages fit together: docs/architecture.md."""
