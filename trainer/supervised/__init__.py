"""The supervised stages on transformers.Trainer: SFT (`parityrl sft`) and reward-model training (`train-rm`)."""
