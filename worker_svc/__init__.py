"""gRPC worker: loads a DeepSeek-V3 checkpoint, picks its precision, streams tokens."""
