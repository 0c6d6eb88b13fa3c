"""The engine's heart: the engine, the scheduler, its requests and the step."""
