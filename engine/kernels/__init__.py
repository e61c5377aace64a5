"""Fused kernels: the Triton GPU decode kernel and the CPU C kernels; each carries a torch reference it is tested against.

Importing this package never imports Triton's compiler work: kernels compile on first call, and
a host without Triton can still import the references. The C extension is optional
(``cpu_attention.NATIVE_ATTENTION``); without it the engine runs its torch path.
"""
