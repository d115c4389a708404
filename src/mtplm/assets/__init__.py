"""What mtplm installs from package registries: pretrained models (models.py) and data sets (datasets.py)."""
