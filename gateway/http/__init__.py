"""HTTP plumbing, under every API: the server and its processes, middlewares, errors, JSON
bodies, validation, server-sent events, the operations routes and the OpenAPI document."""
