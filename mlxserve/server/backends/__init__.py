"""Where generations run: a local engine child process, or another OpenAI-compatible server."""
