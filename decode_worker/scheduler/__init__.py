"""One continuous-batching scheduler for every role: schedule, forward, postprocess (docs/architecture.md)."""
