"""Tool calls on the chat route: the request's tools and tool_choice (``spec``), the prompt that shows them to the
model (``render``), and the model's answer read back into OpenAI ``tool_calls`` (``parsers``, whole or streamed)."""
