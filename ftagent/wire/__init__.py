"""What the agent and the arbiter share: the proto conversion, the shard choice, client
credentials and the limits on every field a peer sends (neither side imports the other)."""
