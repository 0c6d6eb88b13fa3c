"""What a process does before it serves: everything that reads files, joins the group or
talks to other ranks on the way to its plan, so that `mlxserve.policy` stays pure."""
