"""The top floor: the developer commands (``python -m infermesh``, in main.py), the dev runner
and Redis starters, the model writers, the planner, the hardware bench and the fuzz helper.
Nothing below imports it; each module is imported on its own (``python -m
infermesh.probe`` in a service's container loads no more than the probe)."""
