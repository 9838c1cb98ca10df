"""Reliability and benchmark clients (`r9k bench ...`): overload sanity, mixed soak, stock vs
one-page comparison. They talk to any OpenAI-compatible endpoint (a vLLM replica or the fleet
entry point); only `compare` starts replicas itself. Runnable scripts live in `bench/`,
results in `bench/results/`.
"""
