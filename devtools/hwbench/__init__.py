"""``python -m infermesh bench``: measure every GPU kind of a fleet (real, or simulated with
``--sim``) at several concurrencies, and write the table, the raw data and the plots an
architect chooses hardware from.

prices.py reads $/GPU-hour; fleet.py reads the fleet from the gateway's admin API; load.py
sends the requests; results.py turns samples into points, costs and the Pareto frontier;
report.py and plots.py write them; simfleet.py starts a simulated fleet; cli.py ties it up."""
