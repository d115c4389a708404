"""Head-based MTP: the head forms (forms.py), their training on a frozen trunk (train.py,
trunk.py), export."""
