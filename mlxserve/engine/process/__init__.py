"""The engine as a process: its loop, its end of the socket, followers, lockstep, warm-up."""
