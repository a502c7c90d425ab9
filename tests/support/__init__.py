"""What tests and bench/ both start: a Redis, an S3 server and a vLLM stand-in of their own on loopback."""
