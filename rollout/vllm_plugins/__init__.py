"""Code that runs inside vLLM: what the project registers with it or mixes into its workers.

- ``fp8_quant``: the quantization method ``parityrl_fp8_emulated`` (FP8 recipes on CPU);
- ``exact_quant``: the quantization method ``parityrl_exact`` and its attention backend (exact mode);
- ``server_transfer``: the ``parityrl_file`` weight-transfer backend and the worker extension of
  ``parityrl serve`` (``--worker-extension-cls rollout.vllm_plugins.server_transfer.ParityrlWorkerExtension``);
- ``route_capture``: functions run in a vLLM worker that hook its MoE routers and hand out each request's
  routes (``rollout.routes``); it imports vLLM only inside them.

Importing one of them imports vLLM and registers it in the importing process; ``names`` holds the
names they register, importable without vLLM. This package's ``__init__`` imports nothing.
"""
