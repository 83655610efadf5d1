"""`decode-worker bench`: a whole PD deployment per decode cache mode (README, "Decode cache benchmark")."""
