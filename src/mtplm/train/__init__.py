"""Converting a causal LM into a mask-token multi-token predictor: the loop (trainer.py), its trainable
variants (recipes.py), objectives (objectives.py), the slot forward (slots.py), data, checkpoints, torchrun."""
