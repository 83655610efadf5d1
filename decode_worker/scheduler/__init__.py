"""One continuous-batching scheduler for every role: schedule, forward, postprocess, over an explicit request
lifecycle.

How the packages fit together: docs/architecture.md."""
