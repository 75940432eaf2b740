"""Adapters for the event log: the embedded broker, topic set-up, publishing, Tansu remedies,
fetcher settings."""
