"""Where a mismatch comes from: ``parityrl compare`` (``compare``; its checked inputs, ``compare_inputs``; its
report's rows and self-check, ``compare_report``). The engine and the trainer on the same token ids, outside a
training run.
"""
