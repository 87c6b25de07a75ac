"""The Triton kernels behind kernel.py, one family per module: common (the plumbing every family uses and the
switches tests flip), norm_rope, sliding, dsa_index, dsa_attention, moe_route, expert_gemm, experts, linear. kernel.py
is the interface: its dispatchers call the launchers here, and nothing here imports it.

A regular package (this file): a directory without one would lose to an installed distribution named `kernels`
(huggingface's, in this virtualenv) wherever the repository root leads sys.path, as it does for the scripts and tests.
"""
