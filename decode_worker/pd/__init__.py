"""The engine-level halves of prefill/decode disaggregation: the handshake, prefill holding and pushing KV, decode
receiving it.

How the packages fit together: docs/architecture.md."""
