"""The OpenAI-compatible server: HTTP in this process, the engine behind ZeroMQ in child processes.

Modules: `api` (routes, SSE), `protocol` (OpenAI request/response shapes), `engine_client` (the
API side of the sockets), `launcher` (process lifecycle), and one module per child process:
`engine_core`, `detokenizer_proc`, `preprocess_worker`. Message types live in `vlm_engine.ipc`.
"""
