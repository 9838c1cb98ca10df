"""The ground floor every part shares: capacity (the one source of every page, block, token
and pinning number), the page layout, readers of vLLM's metrics, the fleet status model,
errors and a small HTTP client. Light: the plugin imports it in every vLLM process."""
