"""Company profiles by a CrewAI researcher + writer crew; the writer is trained (see README.md)."""
