"""`decode-worker bench`: a PD deployment per decode cache mode (README)."""
