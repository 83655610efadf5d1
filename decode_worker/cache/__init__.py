"""The KV pages and what is in them: pools, the radix tree, the L1/L2 hierarchical cache, L3 storage, and the
PrefixCache protocol the scheduler uses.

How the packages fit together: docs/architecture.md."""
