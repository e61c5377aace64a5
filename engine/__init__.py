"""Model execution shared by the prefill and decode workers: load, schedule, run, sample."""
