"""Developer tools: the tiny hybrid model generator, `r9k demo`, engine runs in a fresh process
and their shared scenarios. Production code (the plugin, deploy, ops, monitoring) never imports
them; tests, benchmarks and the CLI's `model` and `demo` commands do."""
