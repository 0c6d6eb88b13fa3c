"""The engine's heart: the loop, the scheduler, its requests and the step plan."""
