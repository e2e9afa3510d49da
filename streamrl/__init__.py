"""streamrl: asynchronous, off-policy, streaming RL for LLM reasoning with tools."""

__version__ = "0.1.0"
