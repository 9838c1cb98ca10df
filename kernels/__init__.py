"""r9k.kernels: the GDN recurrence for one-page state pages.

Imports nothing from vLLM, click, pydantic or Ray, so GPU test machines without vLLM can load it.
"""
