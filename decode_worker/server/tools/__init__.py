"""Tool calls on the chat route: request (``spec``), prompt (``render``), and answer read back (``parsers``)."""
