"""The front process: the OpenAI-compatible HTTP API in front of one or more engines.

Why a separate process from the engine: a wedged MLX step can only be killed, so
the process that holds the clients' connections must not be the one that can hang.
The front validates and tokenizes, admits requests, routes them to the first
healthy backend, resumes them elsewhere when a backend fails, and restarts failed
local engines. It never runs a model: only the tokenizer is loaded here.
"""
