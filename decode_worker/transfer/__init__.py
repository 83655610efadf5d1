"""The PD data plane: a NIXL agent over the KV pool (registration, peers, page reads, notifications) and how a
registered pool is addressed page by page.

How the packages fit together: docs/architecture.md."""
