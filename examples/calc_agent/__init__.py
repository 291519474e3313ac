"""Arithmetic word problems with an AutoGen AgentChat agent and a calculator tool, trained with
LightningRL: see README.md."""
