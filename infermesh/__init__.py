"""Code shared by the infermesh services: configuration, the generated gRPC
contracts (``infermesh.pb``, built by ``make proto``) and the developer CLI."""
