"""``specgen-train``: learned draft heads (EAGLE, MTP, Medusa) for a frozen target.

data.py features of the target, cached; losses.py pure losses; loop.py the
resumable training loop; evaluate.py held-out acceptance; cli.py the command.
"""
