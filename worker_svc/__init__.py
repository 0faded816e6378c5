"""gRPC worker: loads a DeepSeek-V3 or DeepSeek-V2 checkpoint, picks its precision, streams
tokens."""
