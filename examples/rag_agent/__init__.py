"""Retrieval QA over a synthetic encyclopedia with the OpenAI Agents SDK (see README.md)."""
