"""``jaxserve serve``: the flag table and what it becomes (``flags.py``), vLLM's flags that mean
nothing here (``vllm_flags.py``), the checks made before anything loads (``preflight.py``), and
the start, serving and draining of one server process (``serve.py``).
"""
