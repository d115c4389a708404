"""`mtplm bench` and what it reports: the run (run.py), task scoring (tasks.py), cost table, machine facts,
and the demo."""
