"""Builds the engine from the flags; the offline ``LLM``."""
