"""What the API rooms (openai/, anthropic/) share: one request's admitted generation over
the mesh, the sampling and tool fields every wire format maps, and their common wire types."""
