"""A BFCL (Berkeley Function Calling Leaderboard) agent, graded by BFCL's own checkers (see README.md)."""
