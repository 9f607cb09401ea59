"""``specgen-train``: learned draft heads (EAGLE, MTP, Medusa) for a frozen target.

data.py corpora and the feature arrays; extract.py packed prefill features of the
target; shards.py their resumable on-disk cache; losses.py pure losses; loop.py the
resumable training loop; evaluate.py held-out acceptance; cli.py the command.
"""
