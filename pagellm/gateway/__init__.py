"""The gateway: one door in front of many OpenAI-compatible replicas."""
