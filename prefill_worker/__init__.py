"""The prefill role: compute a prompt's KV (reusing cached prefixes) and ship it to a decode worker."""
