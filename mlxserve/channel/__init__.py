"""The local channel between the front process and an engine process."""
