"""Engine adapters: fpv2 prefill attention plugged into unmodified serving engines.

One module per engine concept (``transformers_*``, ``sglang_*``, ``vllm_*``).
This package imports no engine: each adapter module imports its engine when
it is used, so ``import fpv2.serving.adapters`` is cheap and side-effect free.
"""
