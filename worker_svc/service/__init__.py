"""The worker's gRPC side: the Worker servicer and its registration with the routers (`server`),
the shared Serve stream (`serve_server`), the proto conversions (`wire`) and KV blocks between
workers (`kv_transfer`)."""
