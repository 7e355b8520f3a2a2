"""Structured outputs (JSON schema, regex, choice, grammar) and tool calling.

``params`` is plain Python (the engine imports it); ``grammar`` holds the xgrammar compiler and
matchers, ``compile_worker`` the processes that compile (``worker_handle`` drives them),
``fill_thread`` the thread that fills bitmasks; ``tools`` and ``tool_parsers`` belong to the
OpenAI server.
"""
