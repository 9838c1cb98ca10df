"""The vLLM plugin: one GDN state page per request under speculative decoding.

`entry.register` is what vLLM calls (through `r9k.register`); `policy` decides the page mode;
`gdn_layer` and its CPU/GPU halves run the layer. Every touch point on vLLM that is not one of
its extension routes is in `r9k.compat`."""
