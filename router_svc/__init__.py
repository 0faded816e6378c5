"""The router: worker registry and worker choice over gRPC; internal callers' generations as
mesh calls."""
