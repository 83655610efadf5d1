"""The KV pages and what is in them; how the parts fit: docs/architecture.md, "The cache"."""
