"""Converting a causal LM into a mask-token multi-token predictor: the loop (trainer.py, with its set-up in
prepare.py, its steps in loop.py and step.py), its trainable variants (recipes.py), objectives
(objectives.py), the slot forward (slots.py), data, checkpoints, torchrun."""
