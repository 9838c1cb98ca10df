"""Developer tools that ship: the tiny hybrid model generator (`r9k model make-tiny`), `r9k demo`
and the local vLLM server they start. Production code (the plugin, deploy, ops, monitoring) never
imports them. The measurement harnesses and simulations are the checkout's `lab/`."""
