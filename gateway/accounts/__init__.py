"""API keys and what they spend: authentication, limits and usage (atomic in Redis, lua/),
the recent requests, and the admin API over keys and the fleet."""
