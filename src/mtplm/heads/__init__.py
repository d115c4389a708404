"""Head-based MTP (doc 002): the head forms (forms.py), their training on a frozen trunk (train.py,
trunk.py), export."""
