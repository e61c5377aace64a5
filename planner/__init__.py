"""The SLA planner: scales the prefill and decode pools separately from live metrics (README.md)."""
