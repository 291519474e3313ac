"""The crew ``crewai create crew latest_ai_development`` makes (CrewAI 1.x's project template), copied
unchanged: its ``config/agents.yaml`` writes every role as a folded YAML scalar (``role: >``), so each
``Agent.role`` ends with a newline."""
