"""Developer tools: the tiny hybrid model generator, `r9k demo`, engine runs in a fresh process
and their shared scenarios, and the kernel simulations the tests and benchmarks share
(`simulate`: stock per-slot vs one-page over many steps; `triton_sim`: its Triton hooks). Production code (the plugin, deploy, ops, monitoring) never imports
them; tests, benchmarks and the CLI's `model` and `demo` commands do."""
