"""The decode role: receive or compute a prompt's KV, batch continuously, stream tokens back."""
