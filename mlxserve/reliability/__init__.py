"""Keeping the service up when an engine is not: the progress watchdog and test-only faults."""
