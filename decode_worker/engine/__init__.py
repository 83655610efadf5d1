"""Builds the model, cache, scheduler and PD halves from the flags; the offline LLM drives the same scheduler."""
