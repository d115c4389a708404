"""Experiments over training and benchmarking: the recipe sweep (sweep.py, `scripts/sweep.py`) and its
results folder (report.py). This layer sits above train and bench and imports both."""
