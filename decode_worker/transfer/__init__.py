"""The PD data plane: a NIXL agent over the KV pool, and page addressing."""
