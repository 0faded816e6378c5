"""The developer tools, above the services: the commands of ``python -m infermesh`` (main.py),
the dev mesh runner and the Redis starter, the tiny model writer, the planner, the key admin CLI
and the hardware bench. Nothing below imports it; each module is imported on its own."""
