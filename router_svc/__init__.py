"""The router: worker registry, worker choice and stream relay over gRPC."""
