"""The mesh's client side: the route stream to the router, Serve streams to the workers, and
what the gateway learns from the fleet (tokenizers, reasoning formats) or sends it (affinity)."""
