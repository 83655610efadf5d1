"""Tool calls on the chat route."""
