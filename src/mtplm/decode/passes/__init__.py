"""What runs a pass: the backends and their registry (backends.py; the eager pass over ragged sequences,
ragged.py and chunked.py), and the machine's price of a pass by rows (passcost.py, pricing.py). The
compiled pass and mtplm's own kernels are decode/fast/."""
