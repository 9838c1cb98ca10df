"""Reliability and benchmark clients (`r9k bench ...`): overload sanity, mixed soak, stock vs
one-page comparison. They talk to any OpenAI-compatible endpoint (a vLLM replica or the fleet
entry point); only `compare` starts replicas itself. The measurement programs live in the checkout's `lab/`
(not shipped), their results in `lab/results/`.
"""
