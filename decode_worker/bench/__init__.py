"""`decode-worker bench`: the shared-prefix and multi-turn chat benchmark of a whole PD deployment, per decode cache
mode (off, radix, hierarchical, hierarchical + L3, restart over a warm L3), through the router's public HTTP API
and the workers' /metrics."""
