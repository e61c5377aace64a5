MACHINE_KEYS = {"date", "cpu", "cpu_flags", "cpus", "torch_threads", "gpu"}
"""What every bench report's ``machine`` holds (bench.report.machine)."""
