"""The engine-level halves of PD: the handshake, prefill's hold, decode's read."""
