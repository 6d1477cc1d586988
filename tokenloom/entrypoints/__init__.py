"""How people reach the engine: the Python API (``LLM``), the command line (``cli/``) and the HTTP server
(``server/``), each translating its requests onto the engine's."""
