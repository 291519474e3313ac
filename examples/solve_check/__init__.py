"""solve_check: two agents that need opposite behaviour on one base model (a solver and a checker),
trained with one shared policy or with an adapter per agent. See README.md."""
