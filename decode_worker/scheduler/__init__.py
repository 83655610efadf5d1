"""One continuous-batching scheduler for every role."""
