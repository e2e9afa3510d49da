"""Run model-written code in isolation, with Code Judge's semantics (see types.py)."""
