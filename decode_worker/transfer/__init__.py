"""The PD data plane: UCX channels, the wire format, the KV sender and receiver, staging buffers.

How the packages fit together: docs/architecture.md."""
