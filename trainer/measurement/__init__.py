"""How a batch is measured: the trainer's scores of its tokens (``scoring``, in ``micro_batches``), the parity probe
after every sync (``probe``), the recipe's limits on the mismatch (``parity_limits``), where in the completions it
sits (``parity_breakdown``), MoE routing parity and the routes' checks (``routing_parity``), and the held-out
evaluation (``evaluation``). The metric formulas themselves are ``parity.metrics``'.
"""
