"""The ground floor the services share: configuration, gRPC servers and channels, the shared
streams, failover, Redis clients, the services' entry point and the container health probe; the
generated gRPC contracts (``infermesh.pb``, built by ``make proto``) below it."""
