"""Routing: where a request goes. The cache-aware policy (policy.py) over the prefix index of every
worker's cached blocks (prefix_index.py, its key table, block hashing), the router's tokenizer, the
worker directory and the calls to workers. It imports only router's config and errors below it."""
